"""PNG charts for `--plot DIR` (matplotlib, from the `bench` extra)."""
from pathlib import Path

from vattn.report import console

Series = dict[str, tuple[list[float], list[float]]]  # label -> (x, y)


def line_chart(path: Path, title: str, xlabel: str, ylabel: str, series: Series, log_x: bool = False,
               dashed: set[str] = frozenset(), log_y: bool = False) -> None:
    """One line per series; the series named in `dashed` as plain dashed lines
    (a bound, not a measurement)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (x, y) in series.items():
        style = "k--" if label in dashed else "-o" if len(x) < 40 else "-"
        ax.plot(x, y, style, label=label, markersize=4)
    if log_x:
        ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"wrote {path}")
