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
    """argparse that reports a bad flag in one line, from one rank, with exit status 2.

    Under torchrun every rank parses the same command line; a usage dump from each of them buries
    the one useful line."""

    def error(self, message):
        line = f"{self.prog}: error: {message}{self._did_you_mean(message)} (see {self.prog} --help)"
        tell_torchrun(line)
        if first_to_report(message):  # not rank 0 only: torchrun may kill rank 0 before it prints
            print(line, file=sys.stderr, flush=True)
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


def tell_torchrun(line: str) -> None:
    """Under torchrun, leave `line` in the reply file torchrun gives each worker
    (TORCHELASTIC_ERROR_FILE, the file torch's own `@record` writes): torchrun's failure summary
    then ends with ``traceback : <line>`` instead of a link to its docs, so the one line that
    says what to do is also the last thing the user reads. Every rank writes its own file (the
    summary shows the first rank to fail); nothing happens outside torchrun."""
    import json
    import time
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            # the layout torch's own ErrorHandler.record_exception writes (a plain-string message
            # makes torchrun log two more warnings); the summary shows py_callstack
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # the line is already on stderr; torchrun shows its generic summary


def first_to_report(message: str) -> bool:
    """True for the first local rank of this launch to claim `message` (a file created with
    O_EXCL under the temp folder, keyed by torchrun's run id and agent pid); True without torchrun."""
    import hashlib
    import tempfile
    import time
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None or "RANK" not in os.environ:
        return True
    key = hashlib.sha256(f"{run}:{os.getppid()}:{message}".encode()).hexdigest()[:24]
    path = os.path.join(tempfile.gettempdir(), f"megatron-flag-error-{key}")
    try:
        if time.time() - os.stat(path).st_mtime > 60:  # an old launch that had the same agent pid
            os.remove(path)
    except OSError:
        pass
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True  # no temp folder to agree in: every rank prints rather than none
