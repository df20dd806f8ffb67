"""Figures over repeated rounds, shared by the benchmarks (tables and JSON: `vattn.report`)."""
import statistics


def median_figures(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds ({mean, median, p99} figures each on its own); what
    every round has alike (a setting, a name) as it is."""
    out = {}
    for key, value in rounds[0].items():
        if all(r[key] == value for r in rounds):
            out[key] = value
        elif isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in rounds) for k in value}
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in rounds)
        else:
            out[key] = value
    return out
