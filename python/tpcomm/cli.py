"""The `tpcomm` console script: `tpcomm doctor [options]` checks this machine
(tpcomm.doctor); `tpcomm --version` prints the installed version."""
import argparse
import importlib.metadata
import sys


def _version():
    try:
        return importlib.metadata.version("tpcomm")
    except importlib.metadata.PackageNotFoundError:
        from ._version import __version__

        return __version__


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="tpcomm", description="tpcomm's command line.")
    parser.add_argument("--version", action="version", version=f"tpcomm {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("doctor", add_help=False, help="check this machine and print a report for bug reports")
    if not argv or argv[0] not in ("doctor",):
        args = parser.parse_args(argv)  # --version, --help, or an unknown command (argparse says which)
        parser.print_help()
        return 2
    from . import doctor

    return doctor.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
