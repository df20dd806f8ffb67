"""PNG charts for `--plot DIR` (matplotlib, from the `bench` extra)."""
from pathlib import Path

from vattn.bench.report import console

Series = dict[str, tuple[list[float], list[float]]]  # label -> (x, y)


def line_chart(path: Path, title: str, xlabel: str, ylabel: str, series: Series, log_x: bool = False,
               markers: bool = False) -> None:
    """One line per series (markers only, without lines, with `markers`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, (x, y) in series.items():
        ax.plot(x, y, "o" if markers else "-o" if len(x) < 40 else "-", label=label, markersize=4)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"wrote {path}")
