"""The images ``build_images.sh`` built, read from their OCI archives: what the chart relies on.

The chart runs the gputopo image as UID 65532 with a read-only root filesystem and commands
``gputopo-extender`` / ``gputopo-agent`` found on the image's PATH; the kube-scheduler image is
the chart's ``kube-scheduler`` command; pause is the sandbox's entrypoint. Skipped where the images
are not built (``bash gputopo/localcluster/build_images.sh`` as root builds them).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from gputopo.localcluster import find_binaries
from gputopo.localcluster.images import Image, ImageSet, find_images


@pytest.fixture(scope="module")
def images() -> ImageSet:
    bin_dir = find_binaries()
    found = find_images([bin_dir] if bin_dir is not None else [])
    if found is None:
        pytest.skip("the images are not built (bash gputopo/localcluster/build_images.sh, as root)")
    return found


def _blob(archive: tarfile.TarFile, digest: str) -> bytes:
    algo, hexd = digest.split(":", 1)
    f = archive.extractfile(f"blobs/{algo}/{hexd}")
    assert f is not None, digest
    return f.read()


def _config_and_layers(image: Image) -> tuple[dict[str, Any], list[str], Path]:
    with tarfile.open(image.archive) as archive:
        index = json.loads(_blob_file(archive, "index.json"))
        (entry,) = index["manifests"]
        assert entry["annotations"]["org.opencontainers.image.ref.name"] in (image.ref, image.tag)
        manifest = json.loads(_blob(archive, entry["digest"]))
        config = json.loads(_blob(archive, manifest["config"]["digest"]))
        return config, [layer["digest"] for layer in manifest["layers"]], image.archive


def _blob_file(archive: tarfile.TarFile, name: str) -> bytes:
    f = archive.extractfile(name)
    assert f is not None, name
    return f.read()


def _paths_in_layers(archive_path: Path, layers: list[str], wanted: set[str]) -> dict[str, int]:
    """Each wanted path (no leading slash) with its mode in the topmost layer that holds it (the one
    a container sees). Top layer first, stopping once all are found: the base layer is the largest."""
    found: dict[str, int] = {}
    with tarfile.open(archive_path) as archive:
        for digest in reversed(layers):
            if set(found) == wanted:
                break
            algo, hexd = digest.split(":", 1)
            member = archive.extractfile(f"blobs/{algo}/{hexd}")
            assert member is not None
            with tarfile.open(fileobj=member, mode="r|*") as layer:
                for entry in layer:
                    name = entry.name.removeprefix("./")
                    if name in wanted and name not in found:
                        found[name] = entry.mode
    return found


def test_gputopo_image_runs_as_65532_with_both_entry_points(images: ImageSet) -> None:
    config, layers, archive = _config_and_layers(images.one("gputopo"))
    cfg = config["config"]
    assert cfg["User"] == "65532:65532"
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["PATH"].split(":")[0] == "/opt/gputopo/bin"
    assert cfg["Cmd"] == ["gputopo-extender"]
    assert set(cfg["ExposedPorts"]) == {"8888/tcp", "9401/tcp"}
    wanted = {"opt/gputopo/bin/gputopo-extender", "opt/gputopo/bin/gputopo-agent"}
    found = _paths_in_layers(archive, layers, wanted)
    assert set(found) == wanted
    assert all(mode & 0o001 for mode in found.values()), found  # executable by anyone, 65532 included


@pytest.mark.parametrize(
    ("name", "user", "path"),
    [
        ("kube-scheduler", "65532:65532", "usr/local/bin/kube-scheduler"),
        ("pause", "65535:65535", "pause"),
        ("curl", "65532:65532", "usr/bin/curl"),
    ],
)
def test_support_image_has_its_command_and_user(images: ImageSet, name: str, user: str, path: str) -> None:
    image = next(i for i in images.images if i.name == name)
    config, layers, archive = _config_and_layers(image)
    assert config["config"]["User"] == user
    assert set(_paths_in_layers(archive, layers, {path})) == {path}


def test_gputopo_image_is_within_its_size_goal(images: ImageSet) -> None:
    """The issue's goal: at most 150 MB compressed (the archive's layers are gzip)."""
    assert images.one("gputopo").bytes <= 150_000_000
