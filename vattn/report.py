"""Tables on the terminal and JSON on disk, for the commands and every benchmark."""
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 200)  # tables unwrapped in logs and files


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    console.print(table)


def write_json(path: str | None, data: dict) -> None:
    """`data` at `path`, naming the commit and the CPU that measured it."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"commit": COMMIT, **machine()} | data, indent=2) + "\n")
        console.print(f"wrote {path}")


def commit() -> str | None:
    """The checkout's commit, `-dirty` when tracked files differ from it (None outside a git checkout)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict:
    """The CPU's model name and its bfloat16 instructions (`vattn.dtypes.cpu_bf16`)."""
    from vattn.dtypes import cpu_bf16

    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "unknown")
    return {"cpu": name, "cpu_bf16": list(cpu_bf16())}


COMMIT = commit()  # the code a run starts with, whatever is edited while it runs


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)
