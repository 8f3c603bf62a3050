"""A libnvidia-ml.so.1 built here from C source with the system compiler, for machines without a GPU.

The unmodified agent loads it through nvidia-ml-py as it loads NVIDIA's library; a profile file
(`profile.py`) says which GPUs, NVLinks, fabric and faults it reports, and is read again whenever it
changes. `build.py` compiles it into a cache directory; nothing is downloaded.
"""

from gputopo.localcluster.nvmlmock.build import (
    PROFILE_ENV,
    LibraryBuildError,
    build_library,
    exported_functions,
)
from gputopo.localcluster.nvmlmock.profile import (
    FabricSpec,
    GpuSpec,
    LinkSpec,
    Profile,
    profile_for_system,
    write_profile,
)

__all__ = [
    "PROFILE_ENV",
    "FabricSpec",
    "GpuSpec",
    "LibraryBuildError",
    "LinkSpec",
    "Profile",
    "build_library",
    "exported_functions",
    "profile_for_system",
    "write_profile",
]
