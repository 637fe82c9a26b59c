"""The argparse pieces behind megatron/cli/arguments.py: one-line errors with a did-you-mean, and a
help layout that keeps each option and its help on one line."""
from __future__ import annotations

import argparse
import difflib
import os
import shutil
import sys


def int_list(text: str):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, from rank 0 only, with exit status 2.

    Under torchrun every rank parses the same command line; a usage dump from each of them buries
    the one useful line."""

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":
            hint = self._did_you_mean(message)
            print(f"{self.prog}: error: {message}{hint} (see {self.prog} --help)", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def _did_you_mean(self, message: str) -> str:
        """'; did you mean --global-batch-size?' for each mistyped flag argparse did not recognise."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for word in message.split(":", 1)[1].split():
            if not word.startswith("--"):
                continue
            flag = word.split("=", 1)[0]
            dashed = "--" + flag[2:].replace("_", "-")
            close = [dashed] if dashed in known else difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close and close[0] not in hints:
                hints.append(close[0])
        return f"; did you mean {' / '.join(hints)}?" if hints else ""


class HelpFormatter(argparse.HelpFormatter):
    """Short metavars (N, X, STR) and the default after each help text, so that an option and its
    help fit on one line of a 120-column terminal."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=44, width=min(120, shutil.get_terminal_size().columns))

    def _get_default_metavar_for_optional(self, action):
        return {int: "N", float: "X"}.get(action.type, "STR")

    def _get_help_string(self, action):
        default, text = action.default, action.help or ""
        if default is None or isinstance(default, bool) or default == argparse.SUPPRESS or "default" in text:
            return text
        return text + " (default: %(default)s)"
