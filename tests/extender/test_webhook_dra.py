"""The webhook's DRA mode: an opted-in pod's GPUs become a ResourceClaim from a template asking for a clique;
the template is ensured in the pod's namespace (not on a dry run); bad input is refused with its reason."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extender.app import create_listeners
from extender.claimtemplates import ClaimTemplates, TemplateConflict, templates_path
from extender.settings import Settings
from extender.webhook import Admission, DraMode, admit_pod
from gputopo.engine.draclaims import SPEC_DIGEST_ANNOTATION, claim_template
from gputopo.kube import KubeError
from gputopo.model import GPU_RESOURCE, SCHEDULER_NAME
from gputopo.model.jobs import JOB_COMPLETION_INDEX, JOB_NAME, JOBSET_NAME
from gputopo.model.request import NvlinkPolicy, PodRequest
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
# the template store


class FakeTemplateApi:
    """resource.k8s.io/v1 ResourceClaimTemplates in memory: create answers 409 for a taken name."""

    def __init__(self, fail: KubeError | None = None) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail = fail

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("POST", path))
        if self.fail is not None:
            raise self.fail
        key = f"{path}/{body['metadata']['name']}"
        if key in self.objects:
            raise KubeError(409, "already exists", "AlreadyExists", method="POST", path=path)
        self.objects[key] = copy.deepcopy(dict(body))
        return self.objects[key]

    def get(self, path: str) -> dict[str, Any]:
        self.calls.append(("GET", path))
        if path not in self.objects:
            raise KubeError(404, "not found", "NotFound", method="GET", path=path)
        return self.objects[path]


TEMPLATE = claim_template(PodRequest(gpus=4), list_attributes=False)
PATH = templates_path("ml", TEMPLATE.name)


def _stored(api: FakeTemplateApi, body: dict[str, Any]) -> None:
    api.objects[PATH] = body


def _without_digest() -> dict[str, Any]:
    body = TEMPLATE.body("ml")
    del body["metadata"]["annotations"][SPEC_DIGEST_ANNOTATION]
    body["spec"]["spec"]["devices"]["requests"][0]["firstAvailable"][0]["tolerations"] = []  # a defaulted field
    return body


def _other_spec() -> dict[str, Any]:
    body = claim_template(PodRequest(gpus=2), list_attributes=False).body("ml")
    body["metadata"]["name"] = TEMPLATE.name
    return body


@pytest.mark.parametrize(
    ("existing", "conflict"),
    [
        pytest.param(None, False, id="absent: created"),
        pytest.param(TEMPLATE.body("ml"), False, id="ours, same digest"),
        pytest.param(_without_digest(), False, id="same spec with server defaults, no digest"),
        pytest.param(_other_spec(), True, id="another spec under our name"),
    ],
)
def test_ensure_creates_or_accepts_the_same_spec(existing: dict[str, Any] | None, conflict: bool) -> None:
    api = FakeTemplateApi()
    if existing is not None:
        _stored(api, existing)
    store = ClaimTemplates(api)
    if conflict:
        with pytest.raises(TemplateConflict, match=f"ml/{TEMPLATE.name}"):
            store.ensure("ml", TEMPLATE)
        return
    store.ensure("ml", TEMPLATE)
    assert api.objects[PATH]["spec"]["spec"]["devices"]["constraints"] == TEMPLATE.devices["constraints"]


def test_ensure_remembers_for_its_ttl_then_looks_again() -> None:
    now = [0.0]
    api = FakeTemplateApi()
    store = ClaimTemplates(api, clock=lambda: now[0], ttl_seconds=60)
    for _ in range(100):
        store.ensure("ml", TEMPLATE)
    assert api.calls == [("POST", templates_path("ml"))]
    del api.objects[PATH]  # deleted by hand
    now[0] = 61
    store.ensure("ml", TEMPLATE)
    assert PATH in api.objects and store.creates == 2


# --------------------------------------------------------------------------------------------------
# over HTTP: the webhook listener


def _client(api: FakeTemplateApi | None, **kw: Any) -> TestClient:
    listeners = create_listeners(Settings(dra=True, **kw), cluster=FakeSource(), watch=False)
    if api is not None:
        listeners.webhook.state.claim_templates = ClaimTemplates(api)
    return TestClient(listeners.webhook)


def test_the_template_is_made_once_for_many_pods() -> None:
    api = FakeTemplateApi()
    client = _client(api)
    for _ in range(3):
        r = client.post("/mutate", json=_review(_pod({"gputopo.io/nvlink": "required"})))
        assert r.status_code == 200 and r.json()["response"]["allowed"] is True
    assert list(api.objects) == [PATH]
    assert [c for c in api.calls if c[0] == "POST"] == [("POST", templates_path("ml"))]


def test_dry_run_creates_nothing_but_answers_the_patch() -> None:
    api = FakeTemplateApi()
    r = _client(api).post("/mutate", json=_review(_pod({"gputopo.io/nvlink": "required"}), dry_run=True))
    assert r.json()["response"]["allowed"] is True and _ops(r.json())
    assert api.calls == []


@pytest.mark.parametrize(
    ("api", "code", "words"),
    [
        pytest.param(FakeTemplateApi(KubeError(403, "forbidden", "Forbidden")), 503, "Forbidden", id="api refuses"),
        pytest.param(FakeTemplateApi(KubeError(0, "connection refused")), 503, "connection refused", id="unreachable"),
        pytest.param(None, 503, "API server", id="no API client"),
    ],
)
def test_a_template_that_cannot_be_ensured_refuses_the_pod(api: FakeTemplateApi | None, code: int, words: str) -> None:
    r = _client(api).post("/mutate", json=_review(_pod({"gputopo.io/nvlink": "required"})))
    assert r.status_code == 200
    resp = r.json()["response"]
    assert resp["allowed"] is False and resp["status"]["code"] == code
    assert words in resp["status"]["message"]


def test_a_conflicting_template_refuses_the_pod_naming_it() -> None:
    api = FakeTemplateApi()
    _stored(api, _other_spec())
    resp = _client(api).post("/mutate", json=_review(_pod({"gputopo.io/nvlink": "required"}))).json()["response"]
    assert resp["allowed"] is False and resp["status"]["code"] == 409
    assert f"ml/{TEMPLATE.name}" in resp["status"]["message"]


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
