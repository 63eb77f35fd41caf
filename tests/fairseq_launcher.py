"""fairseq's command-line tools, each in a process of its own, forked from a server that has
already imported torch and fairseq.

Importing torch and fairseq costs every ``python -m fairseq_cli.<tool>`` several seconds of CPU,
most of what a tiny model's train or generate run costs, and the suite runs hundreds of them.
The tools still run as they do from a shell: a new process (forked from multiprocessing's
forkserver, which imports but never computes, so no thread pool is forked), fairseq's own
``__main__`` through ``runpy``, the test's argv, working directory and environment, its
stdin, stdout and stderr on file descriptors 0-2, the exit handlers (``atexit``) run, and the exit status an
interpreter would give (an uncaught exception goes through ``sys.excepthook``, which the plugin
replaces for its one-line errors, then status 1).

This module imports nothing of the package: the plugin decides at import whether it runs
inside a fairseq command (``mlmha_fairseq.errors.running_fairseq_command``), which only the
child, with its argv set, can answer.
"""
import atexit
import importlib.util
import logging
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile

# imported once by the server (not by this module): what every tool needs
PRELOAD = ["torch", "fairseq", "fairseq.options", "fairseq.tasks", "fairseq.models",
           "fairseq.checkpoint_utils", "fairseq.sequence_generator"]

_context = None


def _server():
    global _context
    if _context is None:
        # the server's OpenMP runtime reads this once, when torch is loaded; the children set
        # their own count through torch (_child)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(module, argv, env, cwd, stdin_path, stdout_path, stderr_path):
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path, mode in ((0, stdin_path, os.O_RDONLY), (1, stdout_path, os.O_WRONLY), (2, stderr_path, os.O_WRONLY)):
        target = os.open(path, mode)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else 1)
    # as a new interpreter has it: multiprocessing's default start method (multiprocessing made
    # it "forkserver" in this child; fairseq's DataLoader workers started that way would outlive
    # the tool, since they watch for their parent's exit and the server lives on), no logging
    # configured (the tools' basicConfig then applies), and argv[0] the module's file
    # (argparse's prog, the plugin's one-line errors)
    multiprocessing.set_start_method(None, force=True)
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    sys.path.insert(0, os.getcwd())  # as `python -m` puts the current directory first
    sys.argv = [importlib.util.find_spec(module).origin, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # what the interpreter does with an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        atexit._run_exitfuncs()  # as at interpreter exit (DataLoader workers, torch's handlers)
        sys.stdout.flush()
        sys.stderr.flush()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        sys.stderr.flush()
        code = 1
    os._exit(code)


def run_module(module, argv, env, cwd=None, input=None):
    """``python -m module *argv`` as :func:`subprocess.run` with ``capture_output=True,
    text=True`` would run it; returns a :class:`subprocess.CompletedProcess`."""
    with tempfile.TemporaryDirectory(prefix="fairseq-launch-") as scratch:
        paths = [os.path.join(scratch, name) for name in ("stdin", "stdout", "stderr")]
        with open(paths[0], "w") as handle:
            handle.write(input or "")
        for path in paths[1:]:
            open(path, "w").close()
        process = _server().Process(target=_child, args=(module, list(argv), dict(env), cwd and str(cwd), *paths))
        process.start()
        process.join()
        stdout, stderr = (open(path, errors="replace").read() for path in paths[1:])
    return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], process.exitcode, stdout, stderr)
