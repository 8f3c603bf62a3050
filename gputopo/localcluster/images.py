"""Locate or build the container images a ``ContainerdNode`` runs (no registry anywhere).

``build_images.sh`` next to this module builds them (the gputopo image from the repository's
Dockerfile, kube-scheduler per Kubernetes version, pause, and curl for ``helm test``) as OCI
archives cached under ``$GPUTOPO_CACHE/images``, and writes a manifest naming each image's
reference and archive. This module only runs the script and reads the manifest.
``$GPUTOPO_IMAGES_MANIFEST`` names a ready manifest instead (no check that its images are
current: for iterating on code the images need not contain).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gputopo.localcluster.binaries import kubernetes_version, run_script

IMAGES_SCRIPT = Path(__file__).with_name("build_images.sh")
MANIFEST_ENV = "GPUTOPO_IMAGES_MANIFEST"


class ImagesError(RuntimeError):
    """The images are missing, could not be built, or the manifest is unreadable."""


@dataclass(frozen=True)
class Image:
    name: str  # gputopo, kube-scheduler, pause, curl
    ref: str  # e.g. localhost/gputopo:0.1.0
    archive: Path  # OCI archive for `ctr images import`
    bytes: int  # the archive's size (its layers gzip-compressed)

    @property
    def repository(self) -> str:
        return self.ref.rsplit(":", 1)[0]

    @property
    def tag(self) -> str:
        return self.ref.rsplit(":", 1)[1]


@dataclass(frozen=True)
class ImageSet:
    """The built images of one manifest."""

    images: tuple[Image, ...]

    def one(self, name: str, tag: str | None = None) -> Image:
        found = [i for i in self.images if i.name == name and (tag is None or i.tag == tag)]
        if len(found) != 1:
            raise ImagesError(f"the image manifest has {len(found)} images named {name!r} (tag {tag!r}), not one")
        return found[0]

    def scheduler_for(self, bin_dir: Path) -> Image:
        """The kube-scheduler image built from ``bin_dir``'s kube-scheduler."""
        major, minor, patch = kubernetes_version(bin_dir)
        return self.one("kube-scheduler", f"v{major}.{minor}.{patch}")


def _load(manifest: Path) -> ImageSet:
    try:
        doc = json.loads(manifest.read_text())
        images = tuple(
            Image(name=str(i["name"]), ref=str(i["ref"]), archive=Path(i["archive"]), bytes=int(i["bytes"]))
            for i in doc["images"]
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImagesError(f"image manifest {manifest} is unreadable: {e}") from e
    missing = [str(i.archive) for i in images if not i.archive.is_file()]
    if missing:
        raise ImagesError(f"image manifest {manifest} names missing archives: {', '.join(missing)}")
    return ImageSet(images)


def _run(args: Sequence[str], progress: Callable[[str], None] | None) -> tuple[int, str, list[str]]:
    rc, out, tail = run_script(["bash", str(IMAGES_SCRIPT), *args], progress)
    return rc, out.strip().splitlines()[-1] if out.strip() else "", tail


def find_images(bin_dirs: Sequence[Path]) -> ImageSet | None:
    """The images for ``bin_dirs``' kube-schedulers if all are built and current, else None.
    Builds nothing."""
    if os.environ.get(MANIFEST_ENV):
        return _load(Path(os.environ[MANIFEST_ENV]))
    rc, manifest, _ = _run(["--check", *map(str, bin_dirs)], None)
    return _load(Path(manifest)) if rc == 0 and manifest else None


def ensure_images(bin_dirs: Sequence[Path], progress: Callable[[str], None] | None = None) -> ImageSet:
    """Build whatever is missing or out of date (root; the first run takes minutes) and return the
    images. ``progress`` receives the script's progress lines (sizes, build times)."""
    if os.environ.get(MANIFEST_ENV):
        return _load(Path(os.environ[MANIFEST_ENV]))
    rc, manifest, tail = _run([str(d) for d in bin_dirs], progress)
    if rc != 0 or not manifest:
        raise ImagesError(f"{IMAGES_SCRIPT} failed with exit status {rc}; last output:\n" + "\n".join(tail))
    return _load(Path(manifest))
