"""Primus's command line with cegen's patch registered first (the script for ``--script``).

Primus runs ``primus/cli/main.py`` in every worker; its launcher takes another script with
``--script``. This one imports :mod:`cegen.primus`, which registers cegen's patch with
Primus's patch registry, then hands the command line to Primus's own ``main()``::

    primus-cli direct --script /path/to/cegen/python/primus_with_cegen.py -- \\
        train pretrain --config exp.yaml --use_turbo_cross_entropy true

The script lives beside the ``cegen`` package, so the worker finds cegen through the
script's own directory; Primus itself comes from the PYTHONPATH that primus-cli sets up.
Nothing is switched on here: ``use_turbo_cross_entropy`` in the experiment YAML or on the
command line does that (docs/primus.md).
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from primus.cli import main as primus_cli
    except ImportError as error:
        raise SystemExit(
            f"primus_with_cegen: Primus's command line cannot be imported ({error}); run "
            "through primus-cli, or put the Primus checkout on PYTHONPATH") from error
    import cegen.primus  # noqa: F401  (registers megatron.cegen.cross_entropy)

    if len(sys.argv) > 1 and sys.argv[1] == "--":  # as primus/cli/main.py does
        sys.argv.pop(1)
    primus_cli.main()


if __name__ == "__main__":
    main()
