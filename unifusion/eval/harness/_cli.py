"""``unifusion harness``: the harness's own command line (``lm-eval run ...``) with the ``unifusion`` model as the
default ``--model`` and the model arguments explained first in ``--help``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ._args import model_args_help


def cli_main(argv: Sequence[str] | None = None) -> int:
    """The harness's own command line (``lm-eval run ...``) with the ``unifusion`` model registered.

    ``unifusion harness ARGS`` calls this. ``argv`` (default ``sys.argv[1:]``) are the harness's arguments, with or
    without the ``run`` subcommand (``ls``/``validate`` pass through); ``--model`` defaults to ``unifusion`` and
    ``--device`` to ``cuda`` when available, else ``cpu`` (unless a ``--config`` YAML sets them); no arguments or
    ``--help`` print the model arguments (:data:`~unifusion.eval.harness.MODEL_ARGS`) and then the options of a run.

    Returns:
        the exit status (0 on success; the harness's own status when it exits, e.g. 2 for a bad option).
    """
    try:
        from lm_eval._cli import HarnessCLI
    except ImportError as err:  # pragma: no cover - lm-eval < 0.4.10 has another command line
        raise ImportError("unifusion harness needs lm-eval >= 0.4.10 (the lm_eval._cli command line): pip install -U "
                          f"\"unifusion[eval]\" ({err})") from None
    try:
        from lm_eval.utils import setup_logging
    except ImportError:  # pragma: no cover
        setup_logging = None
    args = list(sys.argv[1:] if argv is None else argv)
    commands = ("run", "ls", "validate")
    if not args or args[0] in ("-h", "--help"):
        args = ["run", "--help"]  # the options of a run (--model_args, --tasks, ...), not the command list
    elif args[0] not in commands:
        args = ["run", *args]
    is_run = args[:1] == ["run"]
    if is_run and ("-h" in args or "--help" in args):
        print(model_args_help(), end="")
    if is_run and not any(a in ("--model", "-M") or a.startswith("--model=") for a in args) \
            and not _config_sets(args, "model"):
        args += ["--model", "unifusion"]
    if is_run and not any(a == "--device" or a.startswith("--device=") for a in args) \
            and not _config_sets(args, "device"):
        args += ["--device", "cuda" if torch.cuda.is_available() else "cpu"]  # the harness would assume cuda
    saved = sys.argv
    sys.argv = ["unifusion harness", *args]
    try:
        if setup_logging is not None:
            setup_logging()  # as lm-eval's own entry point does: the harness's INFO lines on stderr
        cli = HarnessCLI()
        _unifusion_help(cli)
        cli.execute(cli.parse_args())
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
    return 0


def _config_sets(args: Sequence[str], key: str) -> bool:
    """Whether a ``--config`` YAML among ``args`` sets ``key`` (so the command line must not override it)."""
    for i, arg in enumerate(args):
        path = args[i + 1] if arg in ("--config", "-C") and i + 1 < len(args) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path is None:
            continue
        try:
            yaml = importlib.import_module("yaml")  # lm-eval's own dependency
            data = yaml.safe_load(Path(path).read_text())
        except Exception:  # the harness reports an unreadable config itself
            return False
        return isinstance(data, dict) and data.get(key) is not None
    return False


def _unifusion_help(cli: Any) -> None:
    """The run parser's usage, --model default and examples say unifusion (cosmetic; skipped if lm-eval's private
    parser layout changes)."""
    run = getattr(getattr(cli, "_subparsers", None), "choices", {}).get("run")
    if run is None:
        return
    run.prog = "unifusion harness"
    run.usage = "unifusion harness --model_args pretrained=DIR[,name=value ...] --tasks <task> [<task> ...] [options]"
    run.epilog = ("examples:\n  unifusion harness --model_args pretrained=DIR --tasks piqa --batch_size 64\n"
                  "  unifusion harness --model_args pretrained=DIR,fair_pmi=True --tasks hellaswag --limit 100\n"
                  "  unifusion harness --model_args pretrained=DIR,num_steps=128,max_gen_toks=64 --tasks bbh_zeroshot")
    for action in run._actions:
        if action.dest == "model":
            action.help = "Model name (default: unifusion; hf, vllm, ... are the harness's own)"
        elif action.dest == "device":
            action.help = "Device to use (default: cuda when available, else cpu; cuda:LOCAL_RANK under torchrun)"
