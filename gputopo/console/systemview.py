"""`gputopo topo --system NAME`: a named system or rack as gputopo builds it, with no cluster.

A tray system (`gb200-tray`) prints as `gputopo topo NODE` prints a node; a rack (`gb200-nvl72`) prints
its tray topology once, then one line per tray: node name, GPUs, NVLink domain and fabric health.
"""

from __future__ import annotations

from gputopo.model import NodeTopology, tray_health
from gputopo.render import render_topology
from gputopo.systems import RACKS, SYSTEMS, VARIANTS, UnknownSystemError, build_rack, build_system


def _domain(topology: NodeTopology) -> str:
    return topology.fabric.clique if topology.fabric is not None else "-"


def rack_text(name: str, rack: str | None = None) -> str:
    """Rack `name` built as rack `rack` (default: the system's name): the tray topology, then its trays."""
    trays = build_rack(name, rack or name)
    gpus = sum(len(t.gpus) for _, t in trays)
    domains = {_domain(t) for _, t in trays}
    one = "one NVLink domain" if len(domains) == 1 else f"{len(domains)} NVLink domains"
    lines = [f"Rack {name}: {len(trays)} trays ({RACKS[name].tray}), {one} of {gpus} GPUs", ""]
    lines.append(render_topology(trays[0][1]).rstrip("\n"))
    lines.append("")
    width = max(len(node) for node, _ in trays)
    lines.append(f"{'TRAY':<{width}}  GPUS  {'NVLINK DOMAIN':<{len(max(domains, key=len))}}  FABRIC")
    for node, t in trays:
        health, why = tray_health(t.gpus)
        fabric = health.value + (f" ({why})" if why else "")
        lines.append(f"{node:<{width}}  {len(t.gpus):<4}  {_domain(t)}  {fabric}")
    return "\n".join(lines) + "\n"


def system_text(name: str) -> str:
    """A named system (or test variant) or rack; UnknownSystemError names every known one."""
    if name in RACKS:
        return rack_text(name)
    if name in SYSTEMS or name in VARIANTS:
        return f"System {name}\n" + render_topology(build_system(name))
    raise UnknownSystemError(name, [*SYSTEMS, *RACKS])
