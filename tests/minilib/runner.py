"""A job runner in the style of Hydra's: it calls the task and, when the task raises, prints the error and
ends the process with status 1 (``sys.exit(1)``) instead of letting the exception reach the interpreter."""
import sys
import traceback
from collections.abc import Callable


def run_job(task: Callable[[], None]) -> None:
    try:
        task()
    except Exception as exc:  # noqa: BLE001 - the runner reports any failure of the task
        traceback.print_exc()
        sys.stderr.write(f"Error executing job: {exc}\n")
        sys.exit(1)
