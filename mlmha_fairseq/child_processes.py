"""Children that end with the process that started them."""
import signal
import sys


def end_with_parent() -> None:
    """A ``preexec_fn``: in the child, before exec, ask Linux to send SIGTERM when the thread
    that started it dies, even by SIGKILL, so that no fairseq-train or fairseq-preprocess
    outlives a killed runner and keeps writing into a folder that a rerun writes again. Other
    systems have no such request; there a killed runner's children must be stopped by hand."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
