"""ResourceClaimTemplate objects, read by the one reader (gputopo.model.claimtemplate) for all three of its
users: the channel templates' informer, the webhook's check of a template of gputopo's name and the keeper's
collector. Hostile objects (wrong types, oversized lists and names, non-string classes and labels, digits of
another script, a copied digest) are refused with a message naming the object and the field, or read as
what they are; each user then does what it did with them: the informer reports the object and keeps nothing,
the webhook's check calls it another spec, the collector leaves it alone and sends no request for it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gputopo.engine.dra.claims import claim_template
from gputopo.extender.watch.computedomains import ChannelTemplates
from gputopo.extender.webhook.claimtemplates import KeeperLimits, TemplateKeeper, same_template
from gputopo.extender.webhook.mutation import DraMode
from gputopo.model import PodRequest
from gputopo.model.claimtemplate import (
    CHANNEL_DEVICE_CLASS,
    COMPUTE_DOMAIN_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    MAX_REQUESTS,
    SPEC_DIGEST_ANNOTATION,
    TemplateError,
    read_claim_template,
    template_meta,
)
from tests.extender.webhook.test_dra import FakeTemplateApi
from tests.objects import with_paths

OURS = claim_template(PodRequest(gpus=4), list_attributes=False)


def channel(name: str = "imex", ns: str = "team", /, **over: Any) -> dict[str, Any]:
    """NVIDIA's channel template for a ComputeDomain; `over` sets dotted paths."""
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": ns, "uid": "u-1", "labels": {COMPUTE_DOMAIN_LABEL: "cd-uid"}},
        "spec": {
            "spec": {"devices": {"requests": [{"name": "c", "exactly": {"deviceClassName": CHANNEL_DEVICE_CLASS}}]}}
        },
    }
    return with_paths(obj, over)


def ours(**over: Any) -> dict[str, Any]:
    """gputopo's own template as the API server returns it; `over` sets dotted paths."""
    obj = OURS.body("team")
    obj["metadata"] |= {"uid": "u-ours", "resourceVersion": "7"}
    return with_paths(obj, over)


def test_the_fields_each_user_reads() -> None:
    imex, mine = read_claim_template(channel()), read_claim_template(ours())
    assert (imex.meta.key, imex.channel, imex.meta.compute_domain_uid, imex.meta.gputopos) == (
        ("team", "imex"),
        True,
        "cd-uid",
        False,
    )
    assert (mine.channel, mine.meta.gputopos, mine.meta.uid, mine.meta.resource_version) == (False, True, "u-ours", "7")
    assert (mine.meta.managed_by, mine.meta.digest) == (MANAGED_BY, OURS.digest)
    assert mine.devices == OURS.devices


LONG = "n" * 100_000

REFUSED = [
    pytest.param(["x"], "ResourceClaimTemplate (unnamed): the object is not an object", id="a list"),
    pytest.param(None, "ResourceClaimTemplate (unnamed): metadata.name", id="null"),
    pytest.param({"metadata": "x"}, "(unnamed): metadata is not an object", id="metadata a string"),
    pytest.param(channel(**{"metadata.name": 5}), "ResourceClaimTemplate team: metadata.name", id="name a number"),
    pytest.param(channel(**{"metadata.namespace": ""}), "ResourceClaimTemplate imex: metadata.name", id="no namespace"),
    pytest.param(
        channel(**{"metadata.labels": {COMPUTE_DOMAIN_LABEL: 7}}),
        f"team/imex: metadata.labels['{COMPUTE_DOMAIN_LABEL}'] must be a string, not int",
        id="the driver label a number",
    ),
    pytest.param(channel(**{"metadata.labels": ["a"]}), "team/imex: metadata.labels is not an object", id="labels"),
    pytest.param(
        ours(**{"metadata.annotations": {SPEC_DIGEST_ANNOTATION: None}}),
        "metadata.annotations['gputopo.io/claim-spec-digest'] must be a string",
        id="the digest null",
    ),
    pytest.param(channel(**{"metadata.uid": 1}), "team/imex: metadata.uid must be a string", id="uid a number"),
    pytest.param(
        ours(**{"metadata.resourceVersion": 12}), "metadata.resourceVersion must be a string", id="rv a number"
    ),
    pytest.param(channel(spec=[]), "team/imex: spec is not an object", id="spec a list"),
    pytest.param(channel(**{"spec.spec": "x"}), "team/imex: spec.spec is not an object", id="spec.spec a string"),
    pytest.param(channel(**{"spec.spec.devices": []}), "spec.spec.devices is not an object", id="devices a list"),
    pytest.param(
        channel(**{"spec.spec.devices.requests": {"c": 1}}),
        f"team/imex: spec.spec.devices.requests is not a list of at most {MAX_REQUESTS}",
        id="requests an object",
    ),
    pytest.param(
        channel(**{"spec.spec.devices.requests": [{"name": "c"}] * (MAX_REQUESTS + 1)}),
        f"spec.spec.devices.requests is not a list of at most {MAX_REQUESTS}",
        id="one request past the API's cap",
    ),
    pytest.param(
        channel(**{"spec.spec.devices.requests": [1]}), "spec.spec.devices.requests[0] is not an object", id="request"
    ),
    pytest.param(
        channel(**{"spec.spec.devices.requests": [{"exactly": ["x"]}]}),
        "spec.spec.devices.requests[0].exactly is not an object",
        id="exactly a list",
    ),
    pytest.param(
        channel(**{"spec.spec.devices.requests": [{"firstAvailable": [{}] * (MAX_REQUESTS + 1)}]}),
        "spec.spec.devices.requests[0].firstAvailable is not a list",
        id="subrequests past the API's cap",
    ),
    pytest.param(
        channel(**{"spec.spec.devices.requests": [{"firstAvailable": [{}, "x"]}]}),
        "spec.spec.devices.requests[0].firstAvailable[1] is not an object",
        id="a subrequest a string",
    ),
]


@pytest.mark.parametrize(("obj", "message"), REFUSED)
def test_a_hostile_template_is_refused_naming_the_object_and_the_field(obj: Any, message: str) -> None:
    with pytest.raises(TemplateError) as err:
        read_claim_template(obj)
    assert message in str(err.value)


def test_an_error_quotes_a_huge_name_briefly() -> None:
    with pytest.raises(TemplateError) as err:
        read_claim_template(channel(LONG, **{"spec": 1}))
    assert len(str(err.value)) < 200 and "team/nnn" in str(err.value)


@pytest.mark.parametrize(
    ("obj", "is_channel", "is_ours"),
    [
        pytest.param(
            channel(**{"spec.spec.devices.requests": [{"exactly": {"deviceClassName": 7}}]}),
            False,
            False,
            id="class a number",
        ),
        pytest.param(
            channel(
                **{"spec.spec.devices.requests": [{"firstAvailable": [{"deviceClassName": CHANNEL_DEVICE_CLASS}]}]}
            ),
            True,
            False,
            id="the channel class among firstAvailable",
        ),
        pytest.param(
            channel(
                **{
                    "spec.spec.devices.requests": [
                        {"exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.c٥m"}}
                    ]
                }
            ),
            False,
            False,
            id="a look-alike class with a non-ASCII character",
        ),
        pytest.param(ours(**{"metadata.name": "gputopo-gpus-٤-x"}), False, True, id="our prefix, Arabic-Indic count"),
        pytest.param(ours(**{"metadata.labels": {MANAGED_BY_LABEL: "someone"}}), False, False, id="not our label"),
        pytest.param(ours(**{"metadata.name": "gputopo-gpusx"}), False, False, id="not our prefix"),
    ],
)
def test_look_alikes_are_read_as_what_they_are(obj: dict[str, Any], is_channel: bool, is_ours: bool) -> None:
    got = read_claim_template(obj)
    assert (got.channel, got.meta.gputopos) == (is_channel, is_ours)


HOSTILE_OURS = [
    pytest.param(ours(**{"metadata.labels": {MANAGED_BY_LABEL: MANAGED_BY, "x": 1}}), id="a label a number"),
    pytest.param(ours(**{"metadata.uid": 5}), id="uid a number"),
    pytest.param(ours(**{"spec.spec": "x"}), id="claim spec a string"),
    pytest.param(ours(**{"spec.spec.devices.requests": [1]}), id="a request a number"),
    pytest.param(ours(**{"spec.spec.extra": {"k": 1}}), id="a claim spec with more than devices"),
]


@pytest.mark.parametrize("obj", HOSTILE_OURS)
def test_the_webhook_calls_a_hostile_copy_of_our_template_another_spec(obj: dict[str, Any]) -> None:
    assert same_template(ours(), OURS)  # the control
    assert not same_template(obj, OURS)


@pytest.mark.parametrize("obj", [pytest.param(p.values[0], id=p.id) for p in REFUSED] + HOSTILE_OURS[:4])
def test_the_informer_reports_a_hostile_template_and_keeps_nothing_of_it(obj: Any) -> None:
    bad: list[tuple[str, Exception]] = []
    channels = ChannelTemplates(lambda kind, _obj, e: bad.append((kind, e)))
    channels.replace([obj, channel("good")])
    assert [k for k, _ in bad] == ["resourceclaimtemplates"] and isinstance(bad[0][1], TemplateError)
    assert channels.channels == {("team", "good")} and channels.compute_domain_of("cd-uid") == "team/good"
    with pytest.raises(TemplateError):
        channels.apply("ADDED", obj)
    assert channels.channels == {("team", "good")}


def test_the_collector_sends_no_request_for_an_unreadable_template() -> None:
    api = FakeTemplateApi()
    api.put("team", ours(**{"metadata.uid": None, "metadata.labels": {MANAGED_BY_LABEL: MANAGED_BY, "x": 1}}))
    keeper = TemplateKeeper(api, claims=DraMode(), limits=KeeperLimits(grace_seconds=0))
    assert [keeper.collect(), keeper.collect()] == [0, 0]
    assert [verb for verb, _ in api.calls] == ["LIST", "LIST"]
    assert len(api.objects) == 1


def test_reading_leaves_the_object_as_it_was() -> None:
    obj = ours()
    before = copy.deepcopy(obj)
    read_claim_template(obj)
    template_meta(obj)
    same_template(obj, OURS)
    assert obj == before
