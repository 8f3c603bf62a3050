"""The webhook's DRA mode: an opted-in pod's GPUs become a ResourceClaim from a template asking for a clique;
the webhook writes nothing (forged or refused reviews leave nothing), the keeper makes the template once the
pod exists and collects the ones no pod names; templates are a bounded set; bad input is refused naming it."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.engine.dra.claims import (
    MEMORY_CLASSES_MIB,
    ClaimTemplate,
    claim_template,
    memory_class,
    memory_quantity,
)
from gputopo.extender.app import create_listeners
from gputopo.extender.settings import Settings
from gputopo.extender.webhook.claimtemplates import (
    ClaimTemplates,
    KeeperLimits,
    TemplateConflict,
    TemplateKeeper,
    templates_path,
)
from gputopo.extender.webhook.mutation import Admission, DraMode, admit_pod
from gputopo.kube import KubeError
from gputopo.model import GPU_RESOURCE, SCHEDULER_NAME
from gputopo.model.claimtemplate import SPEC_DIGEST_ANNOTATION
from gputopo.model.jobs import JOB_COMPLETION_INDEX, JOB_NAME, JOBSET_NAME
from gputopo.model.request import NvlinkPolicy, PodRequest
from gputopo.systems import SYSTEMS
from tests.extender.fake import FakeSource

UID = "705ab4f5-6393-11e8-b7cc-42010a800002"
DRA = DraMode(list_attributes=False)


def _container(name: str, gpus: int | None = None, *, requests: bool = True) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": "x"}
    if gpus is not None:
        c["resources"] = {"limits": {GPU_RESOURCE: str(gpus), "cpu": "1"}}
        if requests:
            c["resources"]["requests"] = {GPU_RESOURCE: str(gpus)}
    return c


def _pod(
    annotations: dict[str, str] | None = None,
    *,
    gpus: int = 4,
    scheduler: str | None = "default-scheduler",
    labels: dict[str, str] | None = None,
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers if containers is not None else [_container("main", gpus)]}
    if init is not None:
        spec["initContainers"] = init
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    meta: dict[str, Any] = {"name": "train-0", "namespace": "ml"}
    if annotations is not None:
        meta["annotations"] = annotations
    if labels is not None:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _review(obj: Any, *, dry_run: bool = False, namespace: str = "ml") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": UID,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": "CREATE",
            "object": obj,
            "dryRun": dry_run,
        },
    }


def _ops(answer: Mapping[str, Any]) -> list[dict[str, Any]]:
    resp = answer["response"]
    if "patch" not in resp:
        return []
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(resp["patch"]))
    return ops


def _apply(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 add/remove over RFC 6901 pointers: as much JSONPatch as the webhook writes."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target = doc
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        if op["op"] == "add":
            target[last] = op["value"]
        else:
            assert op["op"] == "remove"
            del target[last]
    return doc


def _tpl(gpus: int, nvlink: str = "required", mib: int | None = None, lists: bool = False) -> str:
    request = PodRequest(gpus=gpus, nvlink=NvlinkPolicy(nvlink), min_gpu_memory_mib=mib)
    return claim_template(request, list_attributes=lists).name


CLAIM = [{"name": "gpus"}]


def _claimed(pod: dict[str, Any], template: str, scheduler: str | None = SCHEDULER_NAME) -> dict[str, Any]:
    """`pod` as the DRA patch leaves it: GPUs out of every container's resources, the claim in."""
    out = copy.deepcopy(pod)
    if scheduler is not None:
        out["spec"]["schedulerName"] = scheduler
    for key in ("initContainers", "containers"):
        for c in out["spec"].get(key, []):
            res = c.get("resources", {})
            had = any(GPU_RESOURCE in res.get(k, {}) for k in ("limits", "requests"))
            n = int(pod_gpu(c))
            for k in ("limits", "requests"):
                res.get(k, {}).pop(GPU_RESOURCE, None)
            if had and n > 0:
                res["claims"] = CLAIM
    out["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": template}]
    return out


def pod_gpu(c: Mapping[str, Any]) -> str:
    res = c.get("resources", {})
    return str(res.get("limits", {}).get(GPU_RESOURCE) or res.get("requests", {}).get(GPU_RESOURCE) or 0)


JOBSET = {JOBSET_NAME: "llama", JOB_NAME: "llama-w-0", JOB_COMPLETION_INDEX: "0"}
TWO_PLUS_TWO = [_container("a", 2), _container("sidecar"), _container("b", 2, requests=False)]
INIT = [_container("warmup", 8)]
CLAIMED = [{"name": "mine", "resourceClaimTemplateName": "my-template"}]

PATCH_CASES = [
    pytest.param(
        _pod({"gputopo.io/nvlink": "required"}),
        lambda p: _claimed(p, _tpl(4)),
        id="annotated, default scheduler: scheduler set, GPUs become a clique claim",
    ),
    pytest.param(
        _pod({"gputopo.io/nvlink": "preferred"}, scheduler=SCHEDULER_NAME),
        lambda p: _claimed(p, _tpl(4, "preferred"), scheduler=None),
        id="annotated under gputopo's scheduler: the claim only",
    ),
    pytest.param(
        _pod({"gputopo.io/min-gpu-memory": "80Gi"}),
        lambda p: _claimed(p, _tpl(4, mib=81920)),
        id="min HBM goes into the template",
    ),
    pytest.param(
        _pod(labels=JOBSET, scheduler=SCHEDULER_NAME),
        lambda p: _claimed(p, _tpl(4), scheduler=None),
        id="inferred group (JobSet labels) under gputopo's scheduler: claimed, nvlink required by default",
    ),
    pytest.param(_pod(labels=JOBSET), lambda p: p, id="JobSet labels under the default scheduler: untouched"),
    pytest.param(
        _pod({"gputopo.io/nvlink": "required"}, scheduler="volcano"), lambda p: p, id="another scheduler: untouched"
    ),
    pytest.param(_pod({"example.com/x": "1"}), lambda p: p, id="not opted in: untouched"),
    pytest.param(
        _pod({"gputopo.io/nvlink": "required"}, gpus=0),
        lambda p: {**p, "spec": {**p["spec"], "schedulerName": SCHEDULER_NAME}},
        id="no GPUs: the scheduler only",
    ),
    pytest.param(
        {**_pod({"gputopo.io/nvlink": "required"}), "spec": {**_pod()["spec"], "resourceClaims": CLAIMED}},
        lambda p: {**p, "spec": {**p["spec"], "schedulerName": SCHEDULER_NAME}},
        id="claims already there: left alone",
    ),
    pytest.param(
        _pod({"gputopo.io/nvlink": "required"}, containers=TWO_PLUS_TWO),
        lambda p: _claimed(p, _tpl(4)),
        id="two GPU containers share one claim of 4; the sidecar gets none",
    ),
    pytest.param(
        _pod({"gputopo.io/nvlink": "ignore"}, gpus=2, init=INIT),
        lambda p: _claimed(p, _tpl(8, "ignore")),
        id="an init container's 8 GPUs size the claim",
    ),
    pytest.param(
        _pod({"gputopo.io/nvlink": "required"}, gpus=1),
        lambda p: _claimed(p, _tpl(1)),
        id="one GPU: an unconstrained claim",
    ),
]


@pytest.mark.parametrize(("pod", "expected"), PATCH_CASES)
def test_dra_patch_turns_gpus_into_a_claim(pod: dict[str, Any], expected: Any) -> None:
    adm = admit_pod(_review(pod), dra=DRA)
    assert adm.answer["response"]["allowed"] is True
    assert _apply(pod, _ops(adm.answer)) == expected(pod)
    claims = expected(pod)["spec"].get("resourceClaims")
    if claims and claims != CLAIMED:
        assert adm.template is not None and adm.template.name == claims[0]["resourceClaimTemplateName"]
        assert adm.namespace == "ml"
    else:
        assert adm.template is None


def test_list_attributes_give_the_list_template() -> None:
    adm = admit_pod(_review(_pod({"gputopo.io/nvlink": "required"})), dra=DraMode(list_attributes=True))
    assert adm.template is not None and adm.template.name == _tpl(4, lists=True)
    assert adm.template.devices["constraints"][0]["matchAttribute"] == "gpu.gputopo.io/nvlinkCliques"


def test_without_dra_mode_only_the_scheduler_is_set() -> None:
    adm = admit_pod(_review(_pod({"gputopo.io/nvlink": "required"})))
    assert _ops(adm.answer) == [{"op": "add", "path": "/spec/schedulerName", "value": SCHEDULER_NAME}]
    assert adm.template is None


def test_dry_run_is_carried_to_the_caller() -> None:
    adm = admit_pod(_review(_pod({"gputopo.io/nvlink": "required"}), dry_run=True), dra=DRA)
    assert adm.dry_run and adm.template is not None


@pytest.mark.parametrize(
    ("pod", "words"),
    [
        pytest.param(_pod({"gputopo.io/nvlink": "always"}), "gputopo.io/nvlink", id="bad nvlink policy"),
        pytest.param(_pod({"gputopo.io/min-gpu-memory": "lots"}), "gputopo.io/min-gpu-memory", id="bad HBM"),
        pytest.param(_pod({"gputopo.io/nvlink": "required"}, gpus=33), "at most 32 devices", id="over a claim"),
        pytest.param(
            _pod(
                {"gputopo.io/nvlink": "required"},
                containers=[{"name": "c", "resources": {"limits": {GPU_RESOURCE: "x"}}}],
            ),
            "nvidia.com/gpu",
            id="unreadable GPU count",
        ),
    ],
)
def test_a_request_no_claim_can_express_is_refused_naming_it(pod: dict[str, Any], words: str) -> None:
    adm = admit_pod(_review(pod), dra=DRA)
    resp = adm.answer["response"]
    assert resp["allowed"] is False
    assert resp["status"]["code"] == 400
    assert words in resp["status"]["message"]
    assert "patch" not in resp and adm.template is None


def test_bad_annotations_outside_dra_mode_are_still_admitted() -> None:
    assert admit_pod(_review(_pod({"gputopo.io/nvlink": "always"}))).answer["response"]["allowed"] is True


# --------------------------------------------------------------------------------------------------
# the template store: the webhook reads, the keeper writes


class FakeTemplateApi:
    """resource.k8s.io/v1 ResourceClaimTemplates in memory: create answers 409 for a taken name, delete
    honours uid/resourceVersion preconditions, list filters on one label."""

    def __init__(self, fail: KubeError | None = None) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail = fail
        self.version = 0

    def _next(self) -> str:
        self.version += 1
        return str(self.version)

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("POST", path))
        if self.fail is not None:
            raise self.fail
        key = f"{path}/{body['metadata']['name']}"
        if key in self.objects:
            raise KubeError(409, "already exists", "AlreadyExists", method="POST", path=path)
        obj = copy.deepcopy(dict(body))
        obj["metadata"] |= {"uid": f"uid-{self._next()}", "resourceVersion": self._next()}
        self.objects[key] = obj
        return obj

    def get(self, path: str) -> dict[str, Any]:
        self.calls.append(("GET", path))
        if self.fail is not None:
            raise self.fail
        if path not in self.objects:
            raise KubeError(404, "not found", "NotFound", method="GET", path=path)
        return self.objects[path]

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        self.calls.append(("DELETE", path))
        if path not in self.objects:
            raise KubeError(404, "not found", "NotFound", method="DELETE", path=path)
        meta = self.objects[path]["metadata"]
        for k, v in ((body or {}).get("preconditions") or {}).items():
            if meta.get(k) != v:
                raise KubeError(409, "precondition failed", "Conflict", method="DELETE", path=path)
        return self.objects.pop(path)

    def list_items(self, path: str, *, label_selector: str = "") -> tuple[list[dict[str, Any]], str]:
        self.calls.append(("LIST", path))
        key, _, value = label_selector.partition("=")
        items = [o for o in self.objects.values() if not key or o["metadata"].get("labels", {}).get(key) == value]
        return copy.deepcopy(items), str(self.version)

    def put(self, namespace: str, body: dict[str, Any]) -> None:
        """An object someone else wrote."""
        body = copy.deepcopy(body)
        body["metadata"] |= {"namespace": namespace, "uid": f"uid-{self._next()}", "resourceVersion": self._next()}
        self.objects[templates_path(namespace, body["metadata"]["name"])] = body

    def names(self) -> set[tuple[str, str]]:
        return {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in self.objects.values()}


TEMPLATE = claim_template(PodRequest(gpus=4), list_attributes=False)
PATH = templates_path("ml", TEMPLATE.name)


def _without_digest() -> dict[str, Any]:
    body = TEMPLATE.body("ml")
    del body["metadata"]["annotations"][SPEC_DIGEST_ANNOTATION]
    body["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"][0]["tolerations"] = []  # a defaulted field
    return body


def _other_spec() -> dict[str, Any]:
    body = claim_template(PodRequest(gpus=2), list_attributes=False).body("ml")
    body["metadata"]["name"] = TEMPLATE.name
    return body


EIGHT = claim_template(PodRequest(gpus=8), list_attributes=False)


def _copied_digest_one_gpu() -> dict[str, Any]:
    """L6: our name and our digest annotation, copied, over a spec asking for 1 GPU."""
    body = claim_template(PodRequest(gpus=1), list_attributes=False).body("ml")
    body["metadata"]["name"] = EIGHT.name
    body["metadata"]["annotations"][SPEC_DIGEST_ANNOTATION] = EIGHT.digest
    return body


def _with_a_toleration(template: ClaimTemplate) -> dict[str, Any]:
    """Our spec plus a toleration of every device taint (it would let the claim take failed GPUs)."""
    body = template.body("ml")
    body["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"][0]["tolerations"] = [{"operator": "Exists"}]
    return body


@pytest.mark.parametrize(
    ("template", "existing", "conflict"),
    [
        pytest.param(TEMPLATE, None, False, id="absent: fine, the keeper makes it once the pod exists"),
        pytest.param(TEMPLATE, TEMPLATE.body("ml"), False, id="ours"),
        pytest.param(TEMPLATE, _without_digest(), False, id="same spec with server defaults, no digest"),
        pytest.param(TEMPLATE, _other_spec(), True, id="another spec under our name"),
        pytest.param(EIGHT, _copied_digest_one_gpu(), True, id="copied digest over 1 GPU for an 8-GPU pod"),
        pytest.param(TEMPLATE, _with_a_toleration(TEMPLATE), True, id="our spec plus a toleration"),
    ],
)
def test_check_accepts_absent_or_the_same_content_and_refuses_another(
    template: ClaimTemplate, existing: dict[str, Any] | None, conflict: bool
) -> None:
    api = FakeTemplateApi()
    if existing is not None:
        api.put("ml", existing)
    store = ClaimTemplates(api)
    if conflict:
        with pytest.raises(TemplateConflict, match=f"ml/{template.name}"):
            store.check("ml", template)
    else:
        store.check("ml", template)
    assert not any(verb in ("POST", "DELETE") for verb, _ in api.calls)  # a check never writes


def test_check_remembers_for_its_ttl_then_reads_again() -> None:
    now = [0.0]
    api = FakeTemplateApi()
    store = ClaimTemplates(api, clock=lambda: now[0], ttl_seconds=60)
    for _ in range(100):
        store.check("ml", TEMPLATE)
    assert api.calls == [("GET", PATH)]
    now[0] = 61
    store.check("ml", TEMPLATE)
    assert len(api.calls) == 2


# --------------------------------------------------------------------------------------------------
# over HTTP: the webhook listener answers, and writes nothing


def _client(api: FakeTemplateApi | None, **kw: Any) -> TestClient:
    listeners = create_listeners(Settings(dra=True, **kw), cluster=FakeSource(), watch=False)
    if api is not None:
        listeners.webhook.state.claim_templates = ClaimTemplates(api)
    return TestClient(listeners.webhook)


def test_forged_reviews_create_no_template_in_any_namespace() -> None:
    """H1: reviews no real pod follows, into kube-system and other teams' namespaces, are answered with
    the patch and write nothing."""
    api = FakeTemplateApi()
    client = _client(api)
    for namespace in ("kube-system", "team-b", "ml", "default", "gputopo-system"):
        for gpus in (1, 8):
            review = _review(_pod({"gputopo.io/nvlink": "required"}, gpus=gpus), namespace=namespace)
            r = client.post("/mutate", json=review)
            assert r.status_code == 200 and r.json()["response"]["allowed"] is True and _ops(r.json())
    assert api.objects == {}
    assert {verb for verb, _ in api.calls} == {"GET"}


def test_dry_run_answers_the_patch_and_writes_nothing() -> None:
    api = FakeTemplateApi()
    r = _client(api).post("/mutate", json=_review(_pod({"gputopo.io/nvlink": "required"}), dry_run=True))
    assert r.json()["response"]["allowed"] is True and _ops(r.json())
    assert api.objects == {}


@pytest.mark.parametrize(
    ("api", "code", "words"),
    [
        pytest.param(FakeTemplateApi(KubeError(403, "forbidden", "Forbidden")), 503, "Forbidden", id="api refuses"),
        pytest.param(FakeTemplateApi(KubeError(0, "connection refused")), 503, "connection refused", id="unreachable"),
        pytest.param(None, 503, "API server", id="no API client"),
    ],
)
def test_a_template_that_cannot_be_read_refuses_the_pod(api: FakeTemplateApi | None, code: int, words: str) -> None:
    r = _client(api).post("/mutate", json=_review(_pod({"gputopo.io/nvlink": "required"})))
    assert r.status_code == 200
    resp = r.json()["response"]
    assert resp["allowed"] is False and resp["status"]["code"] == code
    assert words in resp["status"]["message"]


def test_a_conflicting_template_refuses_the_pod_naming_it() -> None:
    api = FakeTemplateApi()
    api.put("ml", _other_spec())
    resp = _client(api).post("/mutate", json=_review(_pod({"gputopo.io/nvlink": "required"}))).json()["response"]
    assert resp["allowed"] is False and resp["status"]["code"] == 409
    assert f"ml/{TEMPLATE.name}" in resp["status"]["message"]


# --------------------------------------------------------------------------------------------------
# memory classes: a bounded set of templates


def test_distinct_min_gpu_memory_values_map_to_a_bounded_set_of_templates() -> None:
    """H1: 500 distinct values of gputopo.io/min-gpu-memory made 500 templates; now at most one per class."""
    names = set()
    for mib in range(1000, MEMORY_CLASSES_MIB[-1], MEMORY_CLASSES_MIB[-1] // 500)[:500]:
        adm = admit_pod(_review(_pod({"gputopo.io/min-gpu-memory": f"{mib}Mi"})), dra=DRA)
        assert adm.template is not None, adm.answer
        names.add(adm.template.name)
    assert len(names) <= len(MEMORY_CLASSES_MIB)


def test_a_min_gpu_memory_above_the_largest_class_is_refused_naming_both() -> None:
    too_much = f"{MEMORY_CLASSES_MIB[-1] + 1}Mi"
    resp = admit_pod(_review(_pod({"gputopo.io/min-gpu-memory": too_much})), dra=DRA).answer["response"]
    assert resp["allowed"] is False
    assert (
        too_much in resp["status"]["message"] and memory_quantity(MEMORY_CLASSES_MIB[-1]) in resp["status"]["message"]
    )


KNOWN_GPU_MIB = sorted({g.memory_mib for build in SYSTEMS.values() for g in build("n").gpus})


@given(mib=st.integers(1, MEMORY_CLASSES_MIB[-1]))
def test_a_class_never_gives_less_than_asked_nor_loses_a_known_gpu(mib: int) -> None:
    c = memory_class(mib)
    assert c >= mib
    assert [m for m in KNOWN_GPU_MIB if m >= mib] == [m for m in KNOWN_GPU_MIB if m >= c]


def test_a_configured_memory_class_keeps_a_gpu_the_named_systems_lack() -> None:
    """An A100 40GB (40960 MiB) is in no named system: 40Gi would round past it to the L40S's class,
    unless the extender is told the figure (--dra-memory-classes)."""
    settings = Settings(dra=True, dra_memory_classes="40960, 16160")
    assert {40960, 16160} <= set(settings.memory_classes)
    pod = _pod({"gputopo.io/min-gpu-memory": "40Gi"})
    assert "-46068mi-" in str(admit_pod(_review(pod), dra=DRA).template)
    dra = DraMode(memory_classes=settings.memory_classes)
    adm = admit_pod(_review(pod), dra=dra)
    assert adm.template is not None and "-40gi-" in adm.template.name
    api = FakeTemplateApi()
    keeper = TemplateKeeper(api, claims=DraMode(memory_classes=settings.memory_classes))
    keeper.pod_changed(_live("a", adm.template.name))
    assert keeper.ensure_pending() == 1  # the keeper builds what the webhook named


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        pytest.param({"dra_memory_classes": "40960"}, "--dra", id="classes without --dra"),
        pytest.param({"dra": True, "dra_memory_classes": "40Gi"}, "'40Gi' is not a GPU memory figure", id="not MiB"),
    ],
)
def test_memory_class_settings_that_cannot_work_are_refused(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Settings(**kw)


# --------------------------------------------------------------------------------------------------
# the keeper: templates follow real pods


def _live(
    name: str,
    template: str,
    *,
    namespace: str = "ml",
    scheduler: str = SCHEDULER_NAME,
    phase: str = "Pending",
    deleting: bool = False,
) -> dict[str, Any]:
    """A pod as the informer hands it over, after the webhook's patch."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec = {"schedulerName": scheduler, "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}]}
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _keeper(
    api: FakeTemplateApi, clock: Clock | None = None, ready: Callable[[], bool] = lambda: True, **limits: Any
) -> TemplateKeeper:
    return TemplateKeeper(api, claims=DRA, clock=clock or Clock(), ready=ready, limits=KeeperLimits(**limits))


def test_a_real_pod_gets_its_template_once() -> None:
    api = FakeTemplateApi()
    keeper = _keeper(api)
    for i in range(50):
        keeper.pod_changed(_live(f"w-{i}", TEMPLATE.name))
    assert keeper.ensure_pending() == 1
    assert api.names() == {("ml", TEMPLATE.name)}
    assert api.objects[PATH]["spec"] == TEMPLATE.body("ml")["spec"]
    assert [c for c in api.calls if c[0] == "POST"] == [("POST", templates_path("ml"))]


def test_a_pod_the_api_server_refused_after_the_webhook_leaves_no_template() -> None:
    """H1: the webhook answered (quota or a validating policy then refused the pod): no pod ever reaches the
    informer, so nothing is made."""
    api = FakeTemplateApi()
    keeper = _keeper(api)
    r = _client(api).post("/mutate", json=_review(_pod({"gputopo.io/nvlink": "required"})))
    assert r.json()["response"]["allowed"] is True
    keeper.ensure_pending()
    keeper.collect()
    assert api.objects == {}


MADE_UP = "gputopo-gpus-4-nvlink-0123abcd"


@pytest.mark.parametrize(
    "pod",
    [
        pytest.param(_live("p", TEMPLATE.name, scheduler="default-scheduler"), id="another scheduler's pod"),
        pytest.param(_live("p", TEMPLATE.name, phase="Succeeded"), id="a finished pod"),
        pytest.param(_live("p", TEMPLATE.name, deleting=True), id="a pod being deleted"),
        pytest.param(_live("p", MADE_UP), id="a name in our prefix that our builder never makes"),
        pytest.param(_live("p", "my-template"), id="someone else's template"),
    ],
)
def test_the_keeper_makes_only_what_a_live_pod_of_ours_names_and_we_build(pod: dict[str, Any]) -> None:
    api = FakeTemplateApi()
    keeper = _keeper(api)
    keeper.pod_changed(pod)
    keeper.pods_replaced([pod])
    keeper.ensure_pending()
    assert api.objects == {}


def test_a_namespace_holds_at_most_the_cap_of_templates() -> None:
    api = FakeTemplateApi()
    keeper = _keeper(api, max_per_namespace=2)
    for gpus in (1, 2, 4):
        keeper.pod_changed(_live(f"p{gpus}", claim_template(PodRequest(gpus=gpus), list_attributes=False).name))
    keeper.ensure_pending()
    assert len(api.objects) == 2 and keeper.refused == 1
    keeper.pod_changed(_live("q", claim_template(PodRequest(gpus=2), list_attributes=True).name, namespace="other"))
    assert keeper.ensure_pending() == 0  # the list encoding is not what this keeper builds


def test_the_collector_deletes_an_unused_template_after_the_grace_and_never_a_used_one() -> None:
    api = FakeTemplateApi()
    clock = Clock()
    keeper = _keeper(api, clock, grace_seconds=300)
    used, unused = TEMPLATE, EIGHT
    api.put("ml", used.body("ml"))
    api.put("ml", unused.body("ml"))
    api.put("ml", {**_other_spec(), "metadata": {"name": "not-ours", "labels": {}}})
    keeper.pods_replaced([_live("w", used.name)])
    assert keeper.collect() == 0  # unused from now on
    clock.now += 299
    assert keeper.collect() == 0
    clock.now += 1
    assert keeper.collect() == 1
    assert api.names() == {("ml", used.name), ("ml", "not-ours")}
    keeper.pod_changed(_live("w", used.name), deleted=True)
    keeper.collect()
    clock.now += 300
    assert keeper.collect() == 1 and api.names() == {("ml", "not-ours")}


def test_the_collector_deletes_nothing_before_the_pods_are_listed() -> None:
    api = FakeTemplateApi()
    clock = Clock()
    listed = [False]
    keeper = _keeper(api, clock, grace_seconds=0, ready=lambda: listed[0])
    api.put("ml", TEMPLATE.body("ml"))
    assert keeper.collect() == 0 and api.calls == []
    listed[0] = True
    assert keeper.collect() == 1


def test_the_collector_bounds_its_deletes_per_pass() -> None:
    api = FakeTemplateApi()
    keeper = _keeper(api, grace_seconds=0, max_deletes_per_pass=3)
    for gpus in range(1, 9):
        api.put("ml", claim_template(PodRequest(gpus=gpus), list_attributes=False).body("ml"))
    assert [keeper.collect() for _ in range(4)] == [3, 3, 2, 0]


def test_a_template_deleted_then_named_again_is_made_again() -> None:
    api = FakeTemplateApi()
    keeper = _keeper(api, grace_seconds=0)
    keeper.pod_changed(_live("a", TEMPLATE.name))
    keeper.ensure_pending()
    keeper.pod_changed(_live("a", TEMPLATE.name), deleted=True)
    assert keeper.collect() == 1 and api.objects == {}
    keeper.pod_changed(_live("b", TEMPLATE.name))
    assert keeper.ensure_pending() == 1 and PATH in api.objects


def test_a_template_deleted_by_hand_is_made_again_at_the_next_pass() -> None:
    api = FakeTemplateApi()
    keeper = _keeper(api)
    keeper.pod_changed(_live("a", TEMPLATE.name))
    keeper.ensure_pending()
    del api.objects[PATH]
    keeper.collect()
    assert keeper.ensure_pending() == 1 and PATH in api.objects


def test_the_keeper_leaves_a_conflicting_template_alone() -> None:
    api = FakeTemplateApi()
    api.put("ml", _copied_digest_one_gpu())
    keeper = _keeper(api)
    keeper.pod_changed(_live("a", EIGHT.name))
    assert keeper.ensure_pending() == 0
    assert api.objects[templates_path("ml", EIGHT.name)]["spec"] == _copied_digest_one_gpu()["spec"]


def test_the_cache_tells_the_keeper_of_the_pods_its_informer_sees() -> None:
    api = FakeTemplateApi()
    keeper = _keeper(api)
    listeners = create_listeners(Settings(dra=True), cluster=FakeSource(), watch=False)
    listeners.cache.pod_hook = keeper
    listeners.cache.replace("pods", [])
    listeners.cache.apply("pods", "ADDED", _live("a", TEMPLATE.name))
    assert keeper.ensure_pending() == 1 and PATH in api.objects


def test_dra_list_attributes_needs_dra() -> None:
    with pytest.raises(ValueError, match="--dra-list-attributes"):
        Settings(dra_list_attributes=True)


# --------------------------------------------------------------------------------------------------
# fuzz: random pods never raise, never 5xx, and every patch applies

_text = st.text(st.characters(codec="ascii"), max_size=12)
_quantity = st.one_of(
    st.sampled_from(["0", "1", "2", "4", "8", "33", "1k", "x", "-1", "1.5", ""]), _text, st.integers()
)
_resources = st.fixed_dictionaries(
    {},
    optional={
        "limits": st.dictionaries(st.sampled_from([GPU_RESOURCE, "cpu"]), _quantity, max_size=2),
        "requests": st.one_of(st.dictionaries(st.sampled_from([GPU_RESOURCE, "memory"]), _quantity, max_size=2), _text),
        "claims": st.lists(st.fixed_dictionaries({"name": _text}), max_size=1),
    },
)
_container_st = st.fixed_dictionaries({"name": _text}, optional={"resources": st.one_of(_resources, st.none(), _text)})
_annotations = st.dictionaries(
    st.sampled_from(["gputopo.io/nvlink", "gputopo.io/min-gpu-memory", "gputopo.io/group", "example.com/x"]),
    st.one_of(st.sampled_from(["required", "preferred", "ignore", "80Gi", "0", "llama"]), _text),
    max_size=3,
)
_gpu_limits = st.fixed_dictionaries(
    {"limits": st.fixed_dictionaries({GPU_RESOURCE: st.sampled_from(["1", "2", "4", "8", 3])})},
    optional={"requests": st.fixed_dictionaries({GPU_RESOURCE: st.sampled_from(["1", "4"])})},
)
_likely = st.builds(  # most random pods are refused or untouched: these make claims
    lambda ann, containers, sched: {
        "metadata": {"annotations": ann},
        "spec": {"containers": containers, **({"schedulerName": sched} if sched else {})},
    },
    st.dictionaries(
        st.sampled_from(["gputopo.io/nvlink", "gputopo.io/min-gpu-memory"]),
        st.sampled_from(["required", "preferred", "ignore", "80Gi", "40000Mi"]),
        min_size=1,
    )
    | st.just({"gputopo.io/nvlink": "required"}),
    st.lists(st.fixed_dictionaries({"name": _text, "resources": _gpu_limits | _resources}), min_size=1, max_size=3),
    st.sampled_from([None, SCHEDULER_NAME, "default-scheduler"]),
)
_pods = _likely | st.fixed_dictionaries(
    {
        "metadata": st.fixed_dictionaries(
            {},
            optional={
                "annotations": st.one_of(_annotations, _text),
                "labels": st.one_of(st.just(JOBSET), st.dictionaries(_text, _text, max_size=2)),
                "namespace": _text,
            },
        ),
        "spec": st.one_of(
            st.fixed_dictionaries(
                {"containers": st.lists(_container_st, max_size=3)},
                optional={
                    "initContainers": st.lists(_container_st, max_size=2),
                    "schedulerName": st.sampled_from([SCHEDULER_NAME, "default-scheduler", "", "volcano"]),
                    "resourceClaims": st.lists(st.just({"name": "x"}), max_size=1),
                },
            ),
            _text,
        ),
    }
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pod=_pods, lists=st.booleans(), namespace=st.sampled_from(["ml", ""]))
def test_random_pods_are_answered_and_every_patch_applies(pod: dict[str, Any], lists: bool, namespace: str) -> None:
    adm = admit_pod(_review(pod, namespace=namespace), dra=DraMode(list_attributes=lists))
    assert isinstance(adm, Admission)
    resp = adm.answer["response"]
    assert resp["uid"] == UID
    if resp["allowed"] and isinstance(pod["spec"], dict):  # the API server only ever sends an object here
        out = _apply(pod, _ops(adm.answer))  # raises if a path does not exist
        if adm.template is not None:
            assert out["spec"]["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": adm.template.name}]
            assert adm.namespace
    elif not resp["allowed"]:
        assert resp["status"]["code"] == 400 and resp["status"]["message"].startswith("gputopo webhook: ")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(pod=_pods)
def test_random_pods_over_http_never_get_a_5xx(pod: dict[str, Any]) -> None:
    r = HTTP.post("/mutate", json=_review(pod))
    assert r.status_code == 200
    assert r.json()["response"]["uid"] == UID


HTTP = _client(FakeTemplateApi())


_names = st.sampled_from([TEMPLATE.name, EIGHT.name, MADE_UP, "gputopo-gpus-", "x", ""]) | _text
_claims = st.lists(
    st.fixed_dictionaries({}, optional={"resourceClaimTemplateName": _names | st.integers()}), max_size=3
)
_informer_pods = st.fixed_dictionaries(
    {},
    optional={
        "metadata": st.fixed_dictionaries(
            {},
            optional={
                "uid": st.sampled_from(["u1", "u2", ""]) | st.integers(),
                "namespace": st.sampled_from(["ml", "kube-system", ""]) | st.none(),
                "deletionTimestamp": st.just("2026-01-01T00:00:00Z"),
            },
        )
        | _text,
        "spec": st.fixed_dictionaries(
            {}, optional={"schedulerName": st.sampled_from([SCHEDULER_NAME, "x"]), "resourceClaims": _claims | _text}
        )
        | st.none(),
        "status": st.fixed_dictionaries({}, optional={"phase": st.sampled_from(["Pending", "Succeeded", 3])}),
    },
)


@settings(max_examples=200, deadline=None)
@given(pods=st.lists(st.tuples(_informer_pods, st.booleans()), max_size=6))
def test_any_pod_the_informer_hands_over_is_taken_and_only_our_names_are_made(
    pods: list[tuple[dict[str, Any], bool]],
) -> None:
    api = FakeTemplateApi()
    keeper = _keeper(api, grace_seconds=0)
    keeper.pods_replaced([p for p, _ in pods])
    for pod, deleted in pods:
        keeper.pod_changed(pod, deleted=deleted)
    keeper.ensure_pending()
    assert {name for _, name in api.names()} <= {TEMPLATE.name, EIGHT.name}
    keeper.collect()
