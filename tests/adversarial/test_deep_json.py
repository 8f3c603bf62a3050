"""Values nested past the JSON decoder's depth, in API answers and watch lines (gputopo.kube.jsonbody): the API
server keeps free-form JSON up to 10,000 deep where a kind allows it (a ResourceClaimTemplate's or a
ResourceClaim's opaque device parameters, a CRD's unpruned fields), and any tenant who may write that kind may
write it. Bounds: a list holding one such object in one namespace still decodes, every other object as it
was and the deep value cut to null past 512 levels; a watch event of one still arrives; brackets inside
strings count for nothing; an answer that is no JSON is refused as before; an ordinary answer costs no
second decode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gputopo.kube import Kube, KubeError, jsonbody
from gputopo.kube.watch import decode_event
from gputopo.model.claimtemplate import CHANNEL_DEVICE_CLASS, read_claim_template
from tests.kube.scripted import kubeconfig
from tests.kube.test_transport import RawServer, framed

JSON = dict[str, Any]


def template(namespace: str, name: str, parameters: Any) -> JSON:
    """A channel template whose request's opaque parameters are `parameters`."""
    devices = {
        "requests": [{"name": "channel", "exactly": {"deviceClassName": CHANNEL_DEVICE_CLASS}}],
        "config": [{"opaque": {"driver": "compute-domain.nvidia.com", "parameters": parameters}}],
    }
    return {"metadata": {"namespace": namespace, "name": name}, "spec": {"spec": {"devices": devices}}}


def nested(depth: int, kind: str) -> str:
    """JSON text of a value `depth` levels deep: arrays, objects, or both in turn."""
    opens = {"array": ["["] * depth, "object": ['{"a":'] * depth, "mixed": ['{"a":', "["] * (depth // 2)}[kind]
    closes = ["]" if o == "[" else "}" for o in reversed(opens)]
    return "".join(opens) + "1" + "".join(closes)


def answer_with(hostile: str) -> bytes:
    """A list of two templates in two namespaces, the first's parameters `hostile` (JSON text)."""
    marker = '"__HOSTILE__"'
    doc = {
        "metadata": {"resourceVersion": "7"},
        "items": [template("tenant", "deep", "__HOSTILE__"), template("other", "honest", {"channel": 0})],
    }
    return json.dumps(doc).replace(marker, hostile).encode()


def depth_of(value: Any) -> int:
    n = 0
    while isinstance(value, list | dict) and value:
        value = value[0] if isinstance(value, list) else next(iter(value.values()))
        n += 1
    return n


@pytest.fixture
def raw(tmp_path: Path) -> Iterator[tuple[RawServer, Kube]]:
    srv = RawServer()
    kube = Kube(kubeconfig(tmp_path / "kubeconfig", srv.url), request_timeout=5.0)
    yield srv, kube
    kube.close()
    srv.close()


@pytest.mark.parametrize(
    "hostile",
    [
        pytest.param(nested(1_100, "array"), id="arrays-1100-deep"),
        pytest.param(nested(1_100, "object"), id="objects-1100-deep"),
        pytest.param(nested(9_999, "mixed"), id="mixed-9999-deep-as-the-api-server-allows"),
        pytest.param(
            '{"s": "' + "[{" * 3_000 + '\\"]", "t": ' + nested(2_000, "array") + "}", id="brackets-inside-strings"
        ),
    ],
)
def test_one_deeply_nested_object_leaves_the_list_of_every_namespace_readable(
    raw: tuple[RawServer, Kube], hostile: str
) -> None:
    srv, kube = raw
    srv.answers.append(framed("200 OK", answer_with(hostile)))
    items, rv = kube.list_items("/apis/resource.k8s.io/v1/resourceclaimtemplates")
    assert rv == "7" and [i["metadata"]["name"] for i in items] == ["deep", "honest"]
    assert read_claim_template(items[1]).channel and read_claim_template(items[0]).channel
    parameters = items[0]["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    assert depth_of(parameters) <= jsonbody.MAX_DEPTH
    if isinstance(parameters, dict) and "s" in parameters:  # the brackets in its string are text, kept
        assert parameters["s"].startswith("[{[{") and len(parameters["s"]) == 6_002
    # The same object as a watch event arrives too.
    line = json.dumps({"type": "MODIFIED", "object": template("tenant", "deep", "__HOSTILE__")})
    event = decode_event(line.replace('"__HOSTILE__"', hostile).encode())
    assert event is not None and event.object["metadata"]["name"] == "deep"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(b"[" * 2_000, id="unbalanced-deep"),
        pytest.param(b"[" * 2_000 + b"]" * 1_999 + b"}", id="mismatched-deep"),
        pytest.param(b'{"a": "' + b"[" * 2_000, id="an-open-string"),
        pytest.param(b"{nope", id="not-json"),
    ],
)
def test_what_is_no_json_is_still_refused(raw: tuple[RawServer, Kube], text: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError):
        jsonbody.loads(text)
    srv, kube = raw
    srv.answers.append(framed("200 OK", text))
    with pytest.raises(KubeError, match="the answer is not JSON"):
        kube.get("/api/v1/nodes")
    assert decode_event(text) is None


def test_an_ordinary_answer_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clipped = 0
    real = jsonbody.clip_deep

    def counted(data: bytes, depth: int = jsonbody.MAX_DEPTH) -> bytes:
        nonlocal clipped
        clipped += 1
        return real(data, depth)

    monkeypatch.setattr(jsonbody, "clip_deep", counted)
    body = answer_with(json.dumps({"channel": [[[[1]]]]}))
    assert jsonbody.loads(body) == orjson.loads(body)
    assert clipped == 0
    jsonbody.loads(answer_with(nested(1_100, "array")))
    assert clipped == 1
