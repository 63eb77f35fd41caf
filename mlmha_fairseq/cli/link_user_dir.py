"""Make ``--user-dir mlmha_fairseq`` work from any directory.

fairseq resolves ``--user-dir`` as a path: relative to the current directory, then next
to fairseq's own package (``site-packages/``). ``pip install .`` puts this package there;
an editable install (``pip install -e .``) does not, so this command links
``site-packages/mlmha_fairseq`` to the package folder. ``make test``/``make demo`` run it.
Usage: ``python -m mlmha_fairseq.cli.link_user_dir``.
"""
import os
import sys

import fairseq

import mlmha_fairseq
from mlmha_fairseq.cli import _support as cli_support


def link_target() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(fairseq.__file__)), "mlmha_fairseq")


def main(argv=None):
    cli_support.make_parser(__spec__.name, __doc__).parse_args(argv)
    package = os.path.dirname(os.path.abspath(mlmha_fairseq.__file__))
    link = link_target()
    if os.path.realpath(link) == os.path.realpath(package):
        print(f"{link} already resolves to {package}")
        return
    if os.path.lexists(link):
        sys.exit(f"error: {link} exists and is not this package ({package}); remove it first")
    os.symlink(package, link)
    print(f"linked {link} -> {package}")


if __name__ == "__main__":
    cli_support.command(main)
