"""A benchmark's view of running servers: their `/metrics` read once or every
`SECONDS`, vattn's and vLLM's alike."""
import threading
import time

SECONDS = 0.5


class Poller:
    """Each model's KV bytes from its server's /metrics every `SECONDS` while a run goes: `samples`,
    (seconds, {model: (held, mapped)}); vLLM holds its share of the budget from its start."""

    def __init__(self, system: str, urls: dict[str, str], budget: int):
        self.system, self.urls, self.third = system, urls, budget // len(urls)
        self.samples: list[tuple[float, dict[str, tuple[float, float]]]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Poller":
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        import httpx

        while not self._stopping.wait(SECONDS):
            sample = {}
            for url in sorted(set(self.urls.values())):
                try:
                    text = httpx.get(url + "/metrics", timeout=5).text
                except httpx.HTTPError:
                    continue
                sample |= self._read(text, url)
            self.samples.append((time.perf_counter() - self._start, sample))

    def _read(self, text: str, url: str) -> dict[str, tuple[float, float]]:
        if self.system == "vllm":
            model = next(m for m, u in self.urls.items() if u == url)
            used = metric(text, "vllm:kv_cache_usage_perc") or 0.0
            return {model: (float(self.third), used * self.third)}
        return {m: (metric(text, "vattn:kv_pool_model_bytes", kind="held", model_name=m) or 0.0,
                    metric(text, "vattn:kv_pool_model_bytes", kind="mapped", model_name=m) or 0.0)
                for m in self.urls}


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first series of `name` with `labels`."""
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    return None


def preemptions(system: str, url: str, model: str) -> float:
    """The model's preemptions so far, as its server counts them."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=5).text
    if system == "vllm":
        return metric(text, "vllm:num_preemptions_total") or 0.0
    return metric(text, "vattn:num_preemptions_total", model_name=model) or 0.0
