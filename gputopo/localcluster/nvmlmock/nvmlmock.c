/* libnvidia-ml.so.1 for machines without a GPU: the NVML calls gputopo's agent makes, with NVML's C
 * signatures, struct layouts, struct versions and return codes (nvml.h, NVML API reference), answering
 * from a profile file named by $GPUTOPO_NVML_PROFILE (format: profile.py in this folder).
 *
 * The profile is read again whenever the file changes (inode, size or mtime), so a test injects a
 * fault under a running agent by writing a new file beside it and renaming it over the old one. A
 * profile that cannot be parsed makes every call answer NVML_ERROR_UNKNOWN and says why on stderr,
 * once per version of the file; the last good profile is dropped, never half-replaced.
 * The file is read whole, only if it is a regular file of at most 4 MiB with no NUL byte (a FIFO,
 * a device or a runaway file is refused, never waited on or half-read).
 * Xid events: `xid GPU CODE` lines form a log; each event set registered for GPU's critical Xids
 * receives every line added after the set was created, once, in file order. A profile with fewer xid
 * lines than the one before starts the log again (all its lines are new). The wait never blocks: with
 * nothing queued it answers NVML_ERROR_TIMEOUT at once, whatever the timeout.
 * Exported functions carry EXPORT; build.py lists them from this source and can leave some out of
 * the library (an older driver's missing symbol).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define NVML_P2P_CAPS_INDEX_NVLINK 2
#define NVML_P2P_STATUS_NOT_SUPPORTED 5
#define NVML_GPU_FABRIC_STATE_NOT_SUPPORTED 0
/* NVML_STRUCT_VERSION(GpuFabricInfo, n): sizeof the struct | n << 24 */
#define NVML_GPU_FABRIC_INFO_V2 0x02000024u
#define NVML_GPU_FABRIC_INFO_V3 0x03000028u

#define NVML_EVENT_TYPE_XID_CRITICAL_ERROR 0x8ull
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xffffffffu

#define MAX_GPUS 64
#define MAX_XIDS 4096
#define MAX_EVENT_SETS 16
#define MAX_LINKS 64
#define MAX_FAILS 32
#define MAX_ABSENT 64
#define TEXT_LEN 96 /* NVML_DEVICE_NAME_V2_BUFFER_SIZE, NVML_DEVICE_UUID_V2_BUFFER_SIZE */
#define BUS_LEN 32  /* NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE */
#define FN_LEN 64
#define LINE_LEN 1024
#define COUNTERS 4 /* NVML_NVLINK_ERROR_DL_REPLAY .. NVML_NVLINK_ERROR_DL_CRC_DATA */
/* Past the largest profile (64 GPUs of 64 links with every field at its widest is under 1 MiB), so a
 * runaway or hostile file is refused before it is read into memory. */
#define MAX_PROFILE_BYTES (4 << 20)

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[BUS_LEN];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2 0x02000028u

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned char state; /* nvmlGpuFabricState_t */
    unsigned int healthMask;
    unsigned char healthSummary; /* v3 only */
} nvmlGpuFabricInfoV_t;

struct nvmlDevice_st {
    int index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

struct link {
    unsigned active, remote_type, version;
    char remote_bus[BUS_LEN];
    unsigned long long counters[COUNTERS];
    int counter_rc[COUNTERS];
};

struct fail {
    char fn[FN_LEN];
    int rc;
};

struct gpu {
    char uuid[TEXT_LEN], name[TEXT_LEN], bus[BUS_LEN];
    unsigned long long memory, numa_mask;
    int has_mig, has_remapped, has_fabric;
    unsigned mig[2], remapped[4];
    unsigned fabric_state, fabric_status, clique_id, health_mask;
    unsigned char cluster_uuid[16];
    int nlinks; /* -1: no NVLink (NOT_SUPPORTED) */
    struct link links[MAX_LINKS];
    unsigned p2p[MAX_GPUS];
    int nfails;
    struct fail fails[MAX_FAILS];
};

struct xid {
    unsigned gpu, code;
};

struct profile {
    int count, nabsent, init_rc, nxids;
    struct xid xids[MAX_XIDS];
    char driver[BUS_LEN];
    char absent[MAX_ABSENT][FN_LEN];
    struct gpu gpus[MAX_GPUS];
};

struct stamp {
    char path[4096];
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct profile *current; /* NULL until a profile parsed */
static struct stamp seen;       /* the file version `current` (or the last bad file) came from */
static int seen_valid, seen_bad, refcount;
static struct nvmlDevice_st handles[MAX_GPUS];

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

struct nvmlEventSet_st {
    int used;
    unsigned long epoch; /* the xid log this cursor counts in */
    int cursor;          /* xid lines before it are delivered (or predate the set) */
    unsigned long long types[MAX_GPUS];
};
typedef struct nvmlEventSet_st *nvmlEventSet_t;
static struct nvmlEventSet_st event_sets[MAX_EVENT_SETS];
static unsigned long xid_epoch; /* bumped when a profile's xid log is shorter than the last one */
static int xid_log_len;

/* ------------------------------------------------------------------------------------------------ */
/* The profile */

static int parse_u64(const char *tok, unsigned long long max, unsigned long long *out) {
    char *end;
    if (tok == NULL || *tok == '\0' || *tok == '-')
        return -1;
    errno = 0;
    unsigned long long v = strtoull(tok, &end, 0);
    if (errno || *end != '\0' || v > max)
        return -1;
    *out = v;
    return 0;
}

static int parse_uint(const char *tok, unsigned max, unsigned *out) {
    unsigned long long v;
    if (parse_u64(tok, max, &v))
        return -1;
    *out = (unsigned)v;
    return 0;
}

static int parse_int(const char *tok, int *out) {
    unsigned v;
    if (parse_uint(tok, 0x7fffffff, &v))
        return -1;
    *out = (int)v;
    return 0;
}

static int copy_token(char *dst, size_t size, const char *tok) {
    if (tok == NULL || strlen(tok) >= size)
        return -1;
    strcpy(dst, tok);
    return 0;
}

static int hexval(int c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* `name` takes the rest of its line, with \xNN for any byte (a name NVML returns undecodable). */
static int unescape(char *dst, size_t size, const char *src) {
    size_t n = 0;
    while (*src) {
        int c = (unsigned char)*src++;
        if (c == '\\') {
            int hi, lo;
            if (src[0] != 'x' || (hi = hexval(src[1])) < 0 || (lo = hexval(src[2])) < 0)
                return -1;
            c = hi * 16 + lo;
            src += 3;
        }
        if (c == 0 || n + 1 >= size)
            return -1;
        dst[n++] = (char)c;
    }
    dst[n] = '\0';
    return 0;
}

static int parse_uuid16(const char *tok, unsigned char out[16]) {
    if (tok == NULL || strlen(tok) != 32)
        return -1;
    for (int i = 0; i < 16; i++) {
        int hi = hexval(tok[2 * i]), lo = hexval(tok[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -1;
        out[i] = (unsigned char)(hi * 16 + lo);
    }
    return 0;
}

#define NEXT() strtok_r(NULL, " \t", &save)
#define WANT(cond, msg)                                                                                   \
    do {                                                                                                  \
        if (!(cond)) {                                                                                    \
            why = msg;                                                                                    \
            goto bad;                                                                                     \
        }                                                                                                 \
    } while (0)

static int parse_link(struct gpu *g, char **savep) {
    char *save = *savep;
    unsigned i;
    if (g->nlinks < 0 || parse_uint(NEXT(), (unsigned)g->nlinks - 1, &i))
        return -1;
    struct link *lk = &g->links[i];
    if (parse_uint(NEXT(), 1, &lk->active) || parse_uint(NEXT(), 0xff, &lk->remote_type) ||
        copy_token(lk->remote_bus, BUS_LEN, NEXT()) || parse_uint(NEXT(), 0xff, &lk->version))
        return -1;
    for (int c = 0; c < COUNTERS; c++)
        if (parse_u64(NEXT(), UINT64_MAX, &lk->counters[c]))
            return -1;
    return NEXT() == NULL ? 0 : -1;
}

/* Parse the whole file into `p`; on error fill `err` (line and why) and return -1. */
static int parse(FILE *f, struct profile *p, char *err, size_t errlen) {
    char line[LINE_LEN + 2];
    const char *why = NULL;
    int lineno = 0;
    struct gpu *g = NULL;
    memset(p, 0, sizeof *p);
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        WANT(len <= LINE_LEN && (len == 0 || line[len - 1] == '\n' || feof(f)), "line too long");
        line[strcspn(line, "\r\n")] = '\0';
        if (lineno == 1) {
            WANT(strcmp(line, "gputopo-nvml-profile 1") == 0, "first line must be 'gputopo-nvml-profile 1'");
            continue;
        }
        if (line[0] == '\0' || line[0] == '#')
            continue;
        if (strncmp(line, "name ", 5) == 0) {
            WANT(g && unescape(g->name, TEXT_LEN, line + 5) == 0, "bad name (\\xNN escapes, under 96 bytes)");
            continue;
        }
        char *save = NULL, *key = strtok_r(line, " \t", &save);
        if (key == NULL)
            continue; /* blanks only */
        if (strcmp(key, "driver") == 0) {
            WANT(copy_token(p->driver, BUS_LEN, NEXT()) == 0, "bad driver version");
        } else if (strcmp(key, "absent") == 0) {
            WANT(p->nabsent < MAX_ABSENT, "too many absent functions");
            WANT(copy_token(p->absent[p->nabsent++], FN_LEN, NEXT()) == 0, "bad function name");
        } else if (strcmp(key, "init-error") == 0) {
            WANT(parse_int(NEXT(), &p->init_rc) == 0, "bad init-error code");
        } else if (strcmp(key, "xid") == 0) {
            WANT(p->nxids < MAX_XIDS, "too many xid lines (at most 4096)");
            struct xid *x = &p->xids[p->nxids++];
            WANT(!parse_uint(NEXT(), MAX_GPUS - 1, &x->gpu) && (int)x->gpu < p->count &&
                     !parse_uint(NEXT(), 0xffffffffu, &x->code) && NEXT() == NULL,
                 "bad xid line (a GPU described above, a code)");
        } else if (strcmp(key, "gpu") == 0) {
            unsigned idx;
            WANT(parse_uint(NEXT(), MAX_GPUS - 1, &idx) == 0 && (int)idx == p->count, "gpu indices must run 0, 1, ...");
            g = &p->gpus[p->count++];
            g->nlinks = -1;
            for (int j = 0; j < MAX_GPUS; j++)
                g->p2p[j] = NVML_P2P_STATUS_NOT_SUPPORTED;
        } else {
            WANT(g != NULL, "a GPU field before the first 'gpu' line");
            if (strcmp(key, "uuid") == 0) {
                WANT(copy_token(g->uuid, TEXT_LEN, NEXT()) == 0, "bad uuid");
            } else if (strcmp(key, "bus") == 0) {
                WANT(copy_token(g->bus, 17, NEXT()) == 0, "bad bus id (at most 16 characters)");
            } else if (strcmp(key, "memory") == 0) {
                WANT(parse_u64(NEXT(), UINT64_MAX, &g->memory) == 0, "bad memory bytes");
            } else if (strcmp(key, "numa-mask") == 0) {
                WANT(parse_u64(NEXT(), UINT64_MAX, &g->numa_mask) == 0, "bad numa-mask");
            } else if (strcmp(key, "mig") == 0) {
                g->has_mig = 1;
                WANT(!parse_uint(NEXT(), 1, &g->mig[0]) && !parse_uint(NEXT(), 1, &g->mig[1]), "bad mig modes");
            } else if (strcmp(key, "remapped") == 0) {
                g->has_remapped = 1;
                for (int j = 0; j < 4; j++)
                    WANT(parse_uint(NEXT(), 0xffffffffu, &g->remapped[j]) == 0, "bad remapped rows");
            } else if (strcmp(key, "fabric") == 0) {
                g->has_fabric = 1;
                WANT(parse_uint(NEXT(), 0xff, &g->fabric_state) == 0, "bad fabric state");
                WANT(parse_uint(NEXT(), 0xffffffffu, &g->fabric_status) == 0, "bad fabric status");
                WANT(parse_uuid16(NEXT(), g->cluster_uuid) == 0, "bad fabric cluster uuid (32 hex digits)");
                WANT(parse_uint(NEXT(), 0xffffffffu, &g->clique_id) == 0, "bad fabric clique id");
                WANT(parse_uint(NEXT(), 0xffffffffu, &g->health_mask) == 0, "bad fabric health mask");
            } else if (strcmp(key, "nvlink") == 0) {
                unsigned n;
                WANT(parse_uint(NEXT(), MAX_LINKS, &n) == 0, "bad nvlink count (at most 64)");
                g->nlinks = (int)n;
            } else if (strcmp(key, "link") == 0) {
                WANT(parse_link(g, &save) == 0, "bad link line (index below the nvlink count, 9 fields)");
            } else if (strcmp(key, "counter-error") == 0) {
                unsigned i, c;
                int rc;
                WANT(g->nlinks > 0 && !parse_uint(NEXT(), (unsigned)g->nlinks - 1, &i) &&
                         !parse_uint(NEXT(), COUNTERS - 1, &c) && !parse_int(NEXT(), &rc),
                     "bad counter-error line (link counter code)");
                g->links[i].counter_rc[c] = rc;
            } else if (strcmp(key, "p2p") == 0) {
                unsigned peer, status;
                WANT(!parse_uint(NEXT(), MAX_GPUS - 1, &peer) && !parse_uint(NEXT(), 0xff, &status), "bad p2p line");
                g->p2p[peer] = status;
            } else if (strcmp(key, "fail") == 0) {
                WANT(g->nfails < MAX_FAILS, "too many fail lines");
                struct fail *fl = &g->fails[g->nfails++];
                WANT(copy_token(fl->fn, FN_LEN, NEXT()) == 0 && parse_int(NEXT(), &fl->rc) == 0, "bad fail line");
            } else {
                WANT(0, "unknown key");
            }
        }
    }
    WANT(lineno > 0, "empty file");
    return 0;
bad:
    snprintf(err, errlen, "line %d: %s", lineno, why);
    return -1;
}

/* The whole file at `path` into a NUL-terminated buffer, its identity into `st`; NULL with `err` filled
 * for what is not a regular file, too large, or holds a NUL byte (which would hide the rest of a line).
 * O_NONBLOCK: a FIFO planted at the path is refused instead of blocking every NVML call. */
static char *read_profile(const char *path, struct stat *st, size_t *len, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open: %s", strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
        snprintf(err, errlen, "not a regular file");
        goto fail;
    }
    if (st->st_size > MAX_PROFILE_BYTES) {
        snprintf(err, errlen, "%lld bytes, at most %d", (long long)st->st_size, MAX_PROFILE_BYTES);
        goto fail;
    }
    buf = malloc(MAX_PROFILE_BYTES + 1);
    size_t n = 0;
    ssize_t got = 1;
    /* Read to EOF, not to st_size: a file growing while read is cut at the cap, never overrun. */
    while (buf != NULL && n <= MAX_PROFILE_BYTES && (got = read(fd, buf + n, MAX_PROFILE_BYTES + 1 - n)) > 0)
        n += (size_t)got;
    if (buf == NULL || got < 0) {
        snprintf(err, errlen, "cannot read: %s", buf == NULL ? "out of memory" : strerror(errno));
        goto fail;
    }
    if (n > MAX_PROFILE_BYTES) {
        snprintf(err, errlen, "grew past %d bytes while read", MAX_PROFILE_BYTES);
        goto fail;
    }
    const char *nul = memchr(buf, '\0', n);
    if (nul != NULL) {
        int line = 1;
        for (const char *c = buf; c < nul; c++)
            line += *c == '\n';
        snprintf(err, errlen, "line %d: a NUL byte", line);
        goto fail;
    }
    buf[n] = '\0';
    *len = n;
    close(fd);
    return buf;
fail:
    free(buf);
    close(fd);
    return NULL;
}

/* Bring `current` up to the file's version; 0 or the code every call answers now. */
static nvmlReturn_t refresh(void) {
    const char *path = getenv("GPUTOPO_NVML_PROFILE");
    struct stat st;
    if (path == NULL || *path == '\0' || strlen(path) >= sizeof seen.path || stat(path, &st) != 0)
        return NVML_ERROR_DRIVER_NOT_LOADED; /* no profile: no driver */
    if (seen_valid && strcmp(seen.path, path) == 0 && seen.dev == st.st_dev && seen.ino == st.st_ino &&
        seen.size == st.st_size && seen.mtime.tv_sec == st.st_mtim.tv_sec &&
        seen.mtime.tv_nsec == st.st_mtim.tv_nsec)
        return seen_bad ? NVML_ERROR_UNKNOWN : NVML_SUCCESS;
    char err[160] = "cannot open";
    size_t len = 0;
    /* The stamp is the opened file's own (fstat), so a file renamed over the path between the stat
     * above and the open is stamped as what was read, and the next call still sees any later change. */
    char *text = read_profile(path, &st, &len, err, sizeof err);
    strcpy(seen.path, path);
    seen.dev = st.st_dev;
    seen.ino = st.st_ino;
    seen.size = st.st_size;
    seen.mtime = st.st_mtim;
    seen_valid = 1;
    if (text != NULL && len == 0)
        snprintf(err, sizeof err, "empty file");
    struct profile *p = text != NULL && len > 0 ? malloc(sizeof *p) : NULL;
    FILE *f = p != NULL ? fmemopen(text, len, "r") : NULL;
    if (f != NULL && parse(f, p, err, sizeof err) == 0) {
        free(current);
        current = p;
        seen_bad = 0;
        if (p->nxids < xid_log_len)
            xid_epoch++;
        xid_log_len = p->nxids;
    } else {
        fprintf(stderr, "libnvidia-ml (gputopo nvmlmock): profile %s: %s\n", path, err);
        free(p);
        free(current);
        current = NULL;
        seen_bad = 1;
    }
    if (f != NULL)
        fclose(f);
    free(text);
    return seen_bad ? NVML_ERROR_UNKNOWN : NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------------------ */
/* Call plumbing: every exported call holds `mu` from BEGIN to its return. */

static nvmlReturn_t begin(const char *fn) {
    nvmlReturn_t rc = refresh();
    if (rc != NVML_SUCCESS)
        return rc;
    if (refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    for (int i = 0; i < current->nabsent; i++)
        if (strcmp(current->absent[i], fn) == 0)
            return NVML_ERROR_FUNCTION_NOT_FOUND; /* an older driver's stub */
    return NVML_SUCCESS;
}

static nvmlReturn_t injected(const struct gpu *g, const char *fn) {
    for (int i = 0; i < g->nfails; i++)
        if (strcmp(g->fails[i].fn, fn) == 0 || strcmp(g->fails[i].fn, "*") == 0)
            return g->fails[i].rc;
    return NVML_SUCCESS;
}

/* The GPU behind `dev`, or the code the call answers. */
static nvmlReturn_t device(const char *fn, nvmlDevice_t dev, struct gpu **out) {
    if (dev < handles || dev >= handles + MAX_GPUS || dev->index >= current->count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &current->gpus[dev->index];
    return injected(*out, fn);
}

static nvmlReturn_t nvlink(const char *fn, nvmlDevice_t dev, unsigned link, struct link **out) {
    struct gpu *g;
    nvmlReturn_t rc = device(fn, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (g->nlinks < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= (unsigned)g->nlinks)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &g->links[link];
    return NVML_SUCCESS;
}

#define BEGIN(fn)                                                                                         \
    pthread_mutex_lock(&mu);                                                                              \
    nvmlReturn_t rc = begin(fn);                                                                          \
    if (rc != NVML_SUCCESS)                                                                               \
        goto out
#define END                                                                                               \
    out:                                                                                                  \
    pthread_mutex_unlock(&mu);                                                                            \
    return rc
#define CHECK(expr)                                                                                       \
    if ((rc = (expr)) != NVML_SUCCESS)                                                                    \
    goto out
#define REQUIRE(cond, code)                                                                               \
    if (!(cond)) {                                                                                        \
        rc = (code);                                                                                      \
        goto out;                                                                                         \
    }

static void fill_pci(nvmlPciInfo_t *pci, const char *bus) {
    unsigned domain = 0, b = 0, d = 0, fn = 0;
    memset(pci, 0, sizeof *pci);
    sscanf(bus, "%x:%x:%x.%x", &domain, &b, &d, &fn);
    snprintf(pci->busId, sizeof pci->busId, "%s", bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", domain & 0xffff, b & 0xff, d & 0xff,
             fn & 0xf);
    pci->domain = domain;
    pci->bus = b;
    pci->device = d;
    pci->pciDeviceId = 0x233010deu;
}

static nvmlReturn_t copy_text(char *dst, unsigned length, const char *src) {
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------------------ */
/* Init, shutdown, errors, system */

static nvmlReturn_t init(const char *fn) {
    pthread_mutex_lock(&mu);
    nvmlReturn_t rc = refresh();
    if (rc == NVML_SUCCESS && current->init_rc != 0)
        rc = current->init_rc;
    if (rc == NVML_SUCCESS) {
        for (int i = 0; i < MAX_GPUS; i++)
            handles[i].index = i;
        refcount++;
    }
    (void)fn;
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return init("nvmlInit_v2"); }

EXPORT nvmlReturn_t nvmlInit(void) { return init("nvmlInit"); }

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return init("nvmlInitWithFlags");
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&mu);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (refcount == 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        refcount--;
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 15: return "GPU is lost";
    case 17: return "The operating system has blocked the request.";
    case 23: return "Insufficient Resources";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    BEGIN("nvmlSystemGetDriverVersion");
    rc = copy_text(version, length, current->driver[0] ? current->driver : "570.124.06");
    END;
}

/* ------------------------------------------------------------------------------------------------ */
/* Devices */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    BEGIN("nvmlDeviceGetCount_v2");
    REQUIRE(count != NULL, NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned)current->count;
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device_out) {
    BEGIN("nvmlDeviceGetHandleByIndex_v2");
    REQUIRE(device_out != NULL && index < (unsigned)current->count, NVML_ERROR_INVALID_ARGUMENT);
    CHECK(injected(&current->gpus[index], "nvmlDeviceGetHandleByIndex_v2"));
    *device_out = &handles[index];
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length) {
    struct gpu *g;
    BEGIN("nvmlDeviceGetUUID");
    CHECK(device("nvmlDeviceGetUUID", dev, &g));
    rc = copy_text(uuid, length, g->uuid);
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length) {
    struct gpu *g;
    BEGIN("nvmlDeviceGetName");
    CHECK(device("nvmlDeviceGetName", dev, &g));
    rc = copy_text(name, length, g->name);
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *memory) {
    struct gpu *g;
    BEGIN("nvmlDeviceGetMemoryInfo");
    CHECK(device("nvmlDeviceGetMemoryInfo", dev, &g));
    REQUIRE(memory != NULL, NVML_ERROR_INVALID_ARGUMENT);
    memory->total = g->memory;
    memory->free = g->memory;
    memory->used = 0;
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *memory) {
    struct gpu *g;
    BEGIN("nvmlDeviceGetMemoryInfo_v2");
    CHECK(device("nvmlDeviceGetMemoryInfo_v2", dev, &g));
    REQUIRE(memory != NULL, NVML_ERROR_INVALID_ARGUMENT);
    REQUIRE(memory->version == NVML_MEMORY_V2, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = g->memory;
    memory->reserved = 0;
    memory->free = g->memory;
    memory->used = 0;
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci) {
    struct gpu *g;
    BEGIN("nvmlDeviceGetPciInfo_v3");
    CHECK(device("nvmlDeviceGetPciInfo_v3", dev, &g));
    REQUIRE(pci != NULL, NVML_ERROR_INVALID_ARGUMENT);
    fill_pci(pci, g->bus);
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t dev, unsigned int nodeSetSize, unsigned long *nodeSet,
                                                int scope) {
    struct gpu *g;
    BEGIN("nvmlDeviceGetMemoryAffinity");
    CHECK(device("nvmlDeviceGetMemoryAffinity", dev, &g));
    REQUIRE(nodeSet != NULL && nodeSetSize > 0 && (scope == 0 || scope == 1), NVML_ERROR_INVALID_ARGUMENT);
    memset(nodeSet, 0, nodeSetSize * sizeof *nodeSet);
    nodeSet[0] = (unsigned long)g->numa_mask;
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *currentMode, unsigned int *pendingMode) {
    struct gpu *g;
    BEGIN("nvmlDeviceGetMigMode");
    CHECK(device("nvmlDeviceGetMigMode", dev, &g));
    REQUIRE(currentMode != NULL && pendingMode != NULL, NVML_ERROR_INVALID_ARGUMENT);
    REQUIRE(g->has_mig, NVML_ERROR_NOT_SUPPORTED);
    *currentMode = g->mig[0];
    *pendingMode = g->mig[1];
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t dev, unsigned int *corrRows, unsigned int *uncRows,
                                              unsigned int *isPending, unsigned int *failureOccurred) {
    struct gpu *g;
    BEGIN("nvmlDeviceGetRemappedRows");
    CHECK(device("nvmlDeviceGetRemappedRows", dev, &g));
    REQUIRE(corrRows && uncRows && isPending && failureOccurred, NVML_ERROR_INVALID_ARGUMENT);
    REQUIRE(g->has_remapped, NVML_ERROR_NOT_SUPPORTED);
    *corrRows = g->remapped[0];
    *uncRows = g->remapped[1];
    *isPending = g->remapped[2];
    *failureOccurred = g->remapped[3];
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t dev, nvmlGpuFabricInfoV_t *info) {
    struct gpu *g;
    BEGIN("nvmlDeviceGetGpuFabricInfoV");
    CHECK(device("nvmlDeviceGetGpuFabricInfoV", dev, &g));
    REQUIRE(info != NULL, NVML_ERROR_INVALID_ARGUMENT);
    unsigned version = info->version;
    REQUIRE(version == NVML_GPU_FABRIC_INFO_V2 || version == NVML_GPU_FABRIC_INFO_V3,
            NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE(g->has_fabric, NVML_ERROR_NOT_SUPPORTED);
    /* Only the caller's version's bytes are written: a v2 struct is 36 bytes, healthSummary is v3's. */
    nvmlGpuFabricInfoV_t filled;
    memset(&filled, 0, sizeof filled);
    filled.version = version;
    memcpy(filled.clusterUuid, g->cluster_uuid, 16);
    filled.status = (nvmlReturn_t)g->fabric_status;
    filled.cliqueId = g->clique_id;
    filled.state = (unsigned char)g->fabric_state;
    filled.healthMask = g->health_mask;
    memcpy(info, &filled, version & 0xffffffu);
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t dev1, nvmlDevice_t dev2, int p2pIndex, int *p2pStatus) {
    struct gpu *g1, *g2;
    BEGIN("nvmlDeviceGetP2PStatus");
    CHECK(device("nvmlDeviceGetP2PStatus", dev1, &g1));
    CHECK(device("nvmlDeviceGetP2PStatus", dev2, &g2));
    REQUIRE(p2pStatus != NULL && p2pIndex >= 0 && p2pIndex <= 5, NVML_ERROR_INVALID_ARGUMENT);
    /* Only NVLink peer-to-peer is described; PCIe read/write/atomics are not modelled. */
    *p2pStatus = p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK ? (int)g1->p2p[dev2->index] : NVML_P2P_STATUS_NOT_SUPPORTED;
    (void)g2;
    END;
}

/* ------------------------------------------------------------------------------------------------ */
/* NVLink */

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t dev, unsigned int link, unsigned int *isActive) {
    struct link *lk;
    BEGIN("nvmlDeviceGetNvLinkState");
    CHECK(nvlink("nvmlDeviceGetNvLinkState", dev, link, &lk));
    REQUIRE(isActive != NULL, NVML_ERROR_INVALID_ARGUMENT);
    *isActive = lk->active;
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t dev, unsigned int link, unsigned int *version) {
    struct link *lk;
    BEGIN("nvmlDeviceGetNvLinkVersion");
    CHECK(nvlink("nvmlDeviceGetNvLinkVersion", dev, link, &lk));
    REQUIRE(version != NULL, NVML_ERROR_INVALID_ARGUMENT);
    *version = lk->version;
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t dev, unsigned int link, int *remoteType) {
    struct link *lk;
    BEGIN("nvmlDeviceGetNvLinkRemoteDeviceType");
    CHECK(nvlink("nvmlDeviceGetNvLinkRemoteDeviceType", dev, link, &lk));
    REQUIRE(remoteType != NULL, NVML_ERROR_INVALID_ARGUMENT);
    *remoteType = (int)lk->remote_type;
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t dev, unsigned int link, nvmlPciInfo_t *pci) {
    struct link *lk;
    BEGIN("nvmlDeviceGetNvLinkRemotePciInfo_v2");
    CHECK(nvlink("nvmlDeviceGetNvLinkRemotePciInfo_v2", dev, link, &lk));
    REQUIRE(pci != NULL, NVML_ERROR_INVALID_ARGUMENT);
    fill_pci(pci, lk->remote_bus);
    END;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t dev, unsigned int link, int counter,
                                                    unsigned long long *counterValue) {
    struct link *lk;
    BEGIN("nvmlDeviceGetNvLinkErrorCounter");
    CHECK(nvlink("nvmlDeviceGetNvLinkErrorCounter", dev, link, &lk));
    REQUIRE(counterValue != NULL && counter >= 0 && counter <= 4, NVML_ERROR_INVALID_ARGUMENT);
    REQUIRE(counter < COUNTERS, NVML_ERROR_NOT_SUPPORTED); /* ECC_DATA: not modelled */
    CHECK(lk->counter_rc[counter]);
    *counterValue = lk->counters[counter];
    END;
}

/* ------------------------------------------------------------------------------------------------ */
/* Events: critical Xids only */

static nvmlReturn_t event_set(nvmlEventSet_t set) {
    if (set < event_sets || set >= event_sets + MAX_EVENT_SETS || !set->used)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    BEGIN("nvmlEventSetCreate");
    REQUIRE(set != NULL, NVML_ERROR_INVALID_ARGUMENT);
    rc = NVML_ERROR_UNKNOWN; /* every set in use */
    for (int i = 0; i < MAX_EVENT_SETS; i++) {
        if (!event_sets[i].used) {
            memset(&event_sets[i], 0, sizeof event_sets[i]);
            event_sets[i].used = 1;
            event_sets[i].epoch = xid_epoch;
            event_sets[i].cursor = current->nxids; /* Xids from before the set are not its */
            *set = &event_sets[i];
            rc = NVML_SUCCESS;
            break;
        }
    }
    END;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t dev, unsigned long long eventTypes, nvmlEventSet_t set) {
    struct gpu *g;
    BEGIN("nvmlDeviceRegisterEvents");
    CHECK(device("nvmlDeviceRegisterEvents", dev, &g));
    CHECK(event_set(set));
    REQUIRE(eventTypes != 0, NVML_ERROR_INVALID_ARGUMENT);
    REQUIRE((eventTypes & ~NVML_EVENT_TYPE_XID_CRITICAL_ERROR) == 0, NVML_ERROR_NOT_SUPPORTED);
    set->types[dev->index] |= eventTypes;
    (void)g;
    END;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    BEGIN("nvmlEventSetWait_v2");
    CHECK(event_set(set));
    REQUIRE(data != NULL, NVML_ERROR_INVALID_ARGUMENT);
    (void)timeoutms;
    if (set->epoch != xid_epoch) {
        set->epoch = xid_epoch;
        set->cursor = 0;
    }
    rc = NVML_ERROR_TIMEOUT;
    while (set->cursor < current->nxids) {
        const struct xid *x = &current->xids[set->cursor++];
        if (set->types[x->gpu] & NVML_EVENT_TYPE_XID_CRITICAL_ERROR) {
            memset(data, 0, sizeof *data);
            data->device = &handles[x->gpu];
            data->eventType = NVML_EVENT_TYPE_XID_CRITICAL_ERROR;
            data->eventData = x->code;
            data->gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
            data->computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
            rc = NVML_SUCCESS;
            break;
        }
    }
    END;
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    BEGIN("nvmlEventSetFree");
    CHECK(event_set(set));
    set->used = 0;
    END;
}
