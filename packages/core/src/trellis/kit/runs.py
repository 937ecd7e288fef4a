"""What a package of tooling around runs needs (trellis-demo): a run's provenance, plots of its metrics, the rule for replacing an output folder."""

from trellis.outdir import check_replaceable
from trellis.plot import plot_metrics
from trellis.runtime.provenance import read as read_provenance

__all__ = [
    # what a run's figures also depend on (versions, CPU), as the run folder's provenance.json holds it
    "read_provenance",
    # PNG curves of metrics from run folders
    "plot_metrics",
    # refuse to replace a folder that something else wrote
    "check_replaceable",
]
