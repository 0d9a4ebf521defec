"""The `tpcomm` console script: one command line over tpcomm's tools, each
keeping its own options (`tpcomm COMMAND --help`):

    tpcomm doctor   check this machine and print a report for bug reports (tpcomm.doctor)
    tpcomm bench    time tpcomm's collectives against NCCL and write JSON and figures (tpcomm.bench)
    tpcomm tune     measure this machine and write the routing table it loads (tpcomm.tune)

`tpcomm --version` prints the installed version."""
import argparse
import importlib
import importlib.metadata
import sys

# command -> (module whose main(argv) runs it, one line of help)
COMMANDS = {
    "doctor": ("tpcomm.doctor", "check this machine and print a report for bug reports"),
    "bench": ("tpcomm.bench.__main__", "time tpcomm's collectives against NCCL (JSON, tables, figures)"),
    "tune": ("tpcomm.tune", "measure this machine and write the routing table it loads"),
}


def _version():
    try:
        return importlib.metadata.version("tpcomm")
    except importlib.metadata.PackageNotFoundError:
        from ._version import __version__

        return __version__


def build_parser():
    parser = argparse.ArgumentParser(prog="tpcomm", description="tpcomm's command line: "
                                     "`tpcomm COMMAND --help` lists a command's options.")
    parser.add_argument("--version", action="version", version=f"tpcomm {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, text) in COMMANDS.items():
        commands.add_parser(name, add_help=False, help=text)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # --version, --help, or an unknown command (argparse says which)
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])  # the command's own argparse reads the rest


if __name__ == "__main__":
    sys.exit(main())
