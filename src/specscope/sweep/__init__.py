"""`specscope sweep`: the investigation's (configuration × environment) matrix, automated. Each cell launches the
engine with the phase plugin on, waits for health, warms up, runs bench-serve's workload, stops the engine and
stores one run carrying the cell's settings; the cells run interleaved (ABBA over repeats), resumably, and the
matrix reports per cell verify / draft / τ / tok/s with their spread, what `compare` says about each axis, and
the break-even τ per cell.

    spec = SweepSpec(command, [parse_flag_axis("speculative-config.num_speculative_tokens=1,3"),
                               parse_env_axis("NCCL_PROTO=LL,Simple")], repeats=2, workload=workload_spec())
    with SweepState.open(workdir, spec, name=None) as state:      # holds the workdir's lock
        run_sweep(state)
        doc = sweep_document(state)

Modules: spec (axes, cells, ABBA order, the command per cell), workload (bench-serve's requests and client), cell
(one cell and its run), state (the resumable sweep file and the workdir's lock), statecheck (every field of a
sweep file checked), run (the loop), pool (a cell's repeats as one record), surface (the engine's verify surface
joined over the num_speculative_tokens axis, one stored run per combination of the other axes), matrix and axes
(the document), render (its words), page (its HTML page, with the report module's parts).
"""

from specscope.sweep.matrix import sweep_document
from specscope.sweep.run import run_sweep
from specscope.sweep.spec import Axis, Cell, SweepSpec, parse_env_axis, parse_flag_axis
from specscope.sweep.state import SweepState
from specscope.sweep.workload import workload_spec

__all__ = ["Axis", "Cell", "SweepSpec", "SweepState", "parse_env_axis", "parse_flag_axis", "run_sweep",
           "sweep_document", "workload_spec"]
