"""`faast serve` under load: requests/s and p50 / p95 latency with 8 memories against the base model alone, at 1, 4
and 8 concurrent clients, through the real openai client on 127.0.0.1 (docs/serving.md, "The server").

    python -m faast_lab.benchmarks.bench_serve                        # the default model (SmolLM2-135M-Instruct)
    python -m faast_lab.benchmarks.bench_serve --base path/to/model --chars 2000 --requests 4 --out /tmp/serve_smoke

One server process (`python -m faast.serve`, --threads torch threads) learns one memory per stdlib package (the first
--chars characters of the package's Python source, faast.hf.demo.domain_files) over HTTP. Then, for each number of
clients, --repeats rounds, each round running the same load twice, interleaved: every client sends --requests
completions of --max-tokens tokens (greedy) one after the other, (a) request j of client c on memory (c + j) mod 8,
so that concurrent requests name different memories and share batches, and (b) on the base model alone. Measured per
request: the time from sending to the whole answer (latency); per load: requests / wall time. The goal (memories p50
latency <= 1.3x the base model's, at every client count) is checked against this run's figures.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from faast_lab.benchmarks import _harness as H

PACKAGES = ["asyncio", "email", "http", "multiprocessing", "xml", "importlib", "unittest", "urllib"]
GOAL = 1.3  # memories p50 latency / base p50 latency, at each client count
PROMPT = "def main():\n    "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="smollm2", help="'smollm2' or a transformers model folder")
    p.add_argument("--chars", type=int, default=16_000, help="characters each memory learns")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=8, help="requests per client per load")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=H.RESULTS / "serve_cpu", help="result file stem")
    return p.parse_args(argv)


def texts() -> dict[str, str]:
    from faast.hf.demo import domain_files

    out = {}
    for package in PACKAGES:
        learn, _ = domain_files(package)
        out[package] = "".join(f.read_text(encoding="utf-8") for f in learn[:40])
    return out


def start_server(args: argparse.Namespace, folder: Path, port: int, threads: int) -> subprocess.Popen:
    import httpx2 as httpx

    command = [
        sys.executable,
        "-m",
        "faast.serve",
        "--base",
        args.base,
        "--name",
        "bench",
        "--memories",
        str(folder),
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--max-resident",
        str(len(PACKAGES)),
        "--exit-after",
        "7200",
    ]
    process = subprocess.Popen(command)
    for _ in range(1200):
        if process.poll() is not None:
            raise SystemExit(f"bench_serve: the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("bench_serve: the server did not start in 10 minutes")


def load(url: str, clients: int, requests: int, max_tokens: int, memories: bool) -> dict:
    """Every client's requests one after another, all clients at once; latencies and requests/s."""
    from openai import OpenAI

    latencies: list[float] = []
    errors: list[str] = []
    barrier = threading.Barrier(clients)

    def client(c: int) -> None:
        api = OpenAI(base_url=url, api_key="-", timeout=600, max_retries=0)
        barrier.wait()
        for j in range(requests):
            model = f"bench:{PACKAGES[(c + j) % len(PACKAGES)]}" if memories else "bench"
            t0 = time.perf_counter()
            try:
                api.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens)
            except Exception as err:  # noqa: BLE001 - counted and reported
                errors.append(repr(err))
                continue
            latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"latencies_s": latencies, "wall_s": wall, "errors": errors}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> dict:
    import httpx2 as httpx

    args = parse_args(argv)
    record = H.start()
    threads = args.threads or H.set_threads()
    port = free_port()
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        server = start_server(args, Path(scratch) / "memories", port, threads)
        try:
            url = f"http://127.0.0.1:{port}"
            learned = {}
            loads = len(args.clients) * args.repeats * 2  # memories and base, interleaved
            bar = H.steps(len(PACKAGES) + loads, "memories learned, then loads")
            for package, text in texts().items():
                t0 = time.perf_counter()
                answer = httpx.post(
                    url + "/v1/memories", json={"name": package, "texts": [text[: args.chars]]}, timeout=3600
                )
                answer.raise_for_status()
                learned[package] = {**answer.json(), "seconds": time.perf_counter() - t0}
                bar.update()
            for clients in args.clients:
                runs[str(clients)] = {"memories": [], "base": []}
                for _ in range(args.repeats):
                    for mode in ("memories", "base"):  # interleaved: a drift of the machine hits both
                        got = load(url + "/v1", clients, args.requests, args.max_tokens, mode == "memories")
                        runs[str(clients)][mode].append(got)
                        bar.update()
            bar.close()
            health = httpx.get(url + "/health").json()
        finally:
            server.terminate()
            server.wait(timeout=60)
    table, ratios = [], {}
    for clients, modes in runs.items():
        row = {}
        for mode, loads in modes.items():
            lat = [x for got in loads for x in got["latencies_s"]]
            done = sum(len(got["latencies_s"]) for got in loads)
            row[mode] = {
                "p50_s": quantile(lat, 0.5),
                "p95_s": quantile(lat, 0.95),
                "errors": sum(len(g["errors"]) for g in loads),
                "requests_per_s": done / sum(got["wall_s"] for got in loads),
            }
        ratios[clients] = row["memories"]["p50_s"] / row["base"]["p50_s"]
        table.append((clients, row))
    payload = {
        "base": args.base,
        "threads": threads,
        "packages": PACKAGES,
        "chars_per_memory": args.chars,
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "learned": learned,
        "results": dict(table),
        "p50_ratio": ratios,
        "goal": GOAL,
        "goal_met": all(r <= GOAL for r in ratios.values()),
        "health": health,
        "runs": runs,
        "torch": torch.__version__,
    }
    body = ["| clients | load | requests/s | p50 latency | p95 latency | errors |", "|---|---|---|---|---|---|"]
    for clients, row in table:
        for mode, m in row.items():
            body.append(
                f"| {clients} | {mode} | {m['requests_per_s']:.2f} | {m['p50_s'] * 1000:.0f} ms | "
                f"{m['p95_s'] * 1000:.0f} ms | {m['errors']} |"
            )
    body += [
        "",
        "p50 latency, 8 memories / base model: "
        + ", ".join(f"{c} clients {r:.2f}" for c, r in ratios.items())
        + f" (goal <= {GOAL}: {'met' if payload['goal_met'] else 'not met'})",
    ]
    title = f"faast serve: 8 memories against the base model, {' / '.join(map(str, args.clients))} clients"
    H.write(args.out, record, payload, title, body)
    print("\n".join([f"# {title}", "", *body]))
    return payload


if __name__ == "__main__":
    main()
