"""The domain suite's runner (issue 74): each suite domain learned once, then solved and scored under every candidate
setting, one result record per domain (a shard), resumable.

    python -m faast_lab.experiments.lm_suite --out lab/experiments/results/lm_suite_cpu   # every domain, default only
    python -m faast_lab.experiments.lm_suite --domains asyncio man1 --settings settings.json --peers lora,lora_time \
        --out DIR

--settings: a JSON object (a file, or the text itself) {setting name: ResidualOutput fields}, or a spec file
(lab/experiments/suite_heuristics.json, suite_untuned_step.json) whose "settings" are that object; "policy" holding
OutputPolicy fields, each over the shipped defaults: {"default": {}, "no_bias": {"bias": 0},
"no_document_shrink": {"policy": {"document_shrink_power": 0}}}; a field of a removed mechanism
(faast.hf.output.policy.REMOVED_FIELDS) is refused. A setting may add an exact cache of the learned text's pairs,
read beside FAAST: "cache": {"lam", "temperature", "k"} (lm_suite_cache; "default_cache": {"cache": {"lam": 0.1,
"temperature": 30}} is the default with it), or one whose λ and T are tuned at each point on FAAST's held-out
tail: "cache": {"tune": true, "k"} (lm_suite_cache.tune). A setting may add middle memory layers read through a
trained readout: "readout": "shipped" (the readout faast ships for SmolLM2, faast.hf.default.DEFAULT_READOUT) or a
save_pretrained folder of one; it learns a pass of its own (`split_readout`). A setting may add memories on the upper
blocks' MLPs, "mlp": {"blocks": [...], "step": η, "ridge": μ (optional)} (lm_suite_mlp); settings with the same
blocks and ridge share a pass and a capture of its keys and values. The first setting is the one LoRA at
FAAST's time gets the time of (list the default first). The runs take the float32 path by default
(FaastConfig(learn_dtype='model'), head_dtype='float32'), as the issue's goals are stated; --path auto takes faast's
own choice.

Per domain (lab/experiments/suite.py: the manifest's files, checked against their hashes first): the learned text's
first --learn-tokens tokens, the held-out files' first --score-tokens in --window-token windows; zero-shot; then each
group of settings that can share a learning pass learns the text once in the curve's parts (--curve), and after each
part every setting of the group is solved and scored. Settings share a pass when they differ only in OutputPolicy
fields that are read only when solving (SOLVE_TIME_FIELDS) and in the biases' steps (bias, token_bias): the layer's
public `policy`, `bias` and `token_bias` setters make the next solve use new ones. Any other difference (another
ResidualOutput field, or a policy field read while learning) learns its own pass: the public API sets those when the
layer is built. A cache is read only when scoring: a cached setting shares the pass and the solve of its setting
without the cache, and its row adds the cache's pairs, bytes and times (lm_suite_cache). Peers (--peers) run through
lm_domains_peers: one LoRA epoch, LoRA at FAAST's time (the first setting's learn + solve time), LoRA-best and the
tuned kNN-LM. Each shard holds faast.provenance's record, the suite's hashes, the protocol and the per-setting
perplexities; lm_suite_report merges the shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from faast_lab.experiments import lm_suite_cache, suite
from faast_lab.experiments._common import ROOT, ModelLoader
from faast_lab.experiments.lm_suite_cache import CACHE, CacheSpec, CacheStates, TunedCacheSpec, split_cache
from faast_lab.experiments.lm_suite_mlp import MLP, MlpCapture, MlpSpec, check_blocks, module_name, split_mlp

# OutputPolicy fields read only by the solve (tuning, diagnosis, biases, the held-out plan and sample): two
# settings that differ only in these share one learning pass and are re-solved. The others (the held-out tail's
# share and gap, which decide what the tail keeps while learning; head pooling; the key layers; the untuned step and
# weight, fixed when the layer is built) need their own pass. A field added to OutputPolicy is not listed here until
# shown solve-only, so it learns its own pass: slower, never wrong.
SOLVE_TIME_FIELDS = frozenset({
    "default_step_per_dim", "token_prior", "min_held_out", "min_fit_tokens", "fit_per_key_dim",
    "tune_sample", "max_step", "step_iterations", "step_tol", "search_sample_stride", "search_sample_min_rows",
    "width_sample_min_rows", "min_grid_step", "golden_iterations", "weight_iterations", "min_gain_se",
    "part_min_positions", "part_step_ratio", "document_positions_per_dim", "document_shrink_power",
    "document_folds_gate"})  # fmt: skip
# ResidualOutput fields the solve alone reads (the layer's public setters): the biases' steps, added after the step
# is tuned.
SOLVE_TIME_OUTPUT_FIELDS = ("bias", "token_bias")
PEERS = ("lora", "lora_time", "lora_best", "knn_tuned")
READOUT = "readout"  # a setting's field: the middle layers' readout folder ("shipped": faast's for SmolLM2)
CURVE = (2048, 8192)  # and the last point, --learn-tokens


def setting_from_dict(name: str, fields: Mapping, path: str = "float32"):  # noqa: ANN201 - a ResidualOutput
    """The ResidualOutput of a setting: the shipped one with `fields` over it ("policy": OutputPolicy fields over the
    shipped policy); the float32 path pins head_dtype='float32' unless the setting names it."""
    from faast.hf import OutputPolicy, ResidualOutput
    from faast.hf.output import REMOVED_FIELDS

    if not isinstance(fields, Mapping):
        raise ValueError(f"--settings: setting {name!r}: expected an object of ResidualOutput fields, got {fields!r}")
    fields = dict(fields)
    policy = fields.pop("policy", {})
    gone = sorted(set(policy) & set(REMOVED_FIELDS)) if isinstance(policy, Mapping) else []
    if gone:  # OutputPolicy would load them with a warning and run the default under this setting's name
        raise ValueError(f"--settings: setting {name!r}: {gone} belong to a mechanism faast no longer has; the shards "
                         "that ran it before keep its results")  # fmt: skip
    if path == "float32":
        fields.setdefault("head_dtype", "float32")
    try:
        return ResidualOutput(**fields, policy=OutputPolicy.from_dict({**OutputPolicy().to_dict(), **policy}))
    except (TypeError, ValueError) as err:
        raise ValueError(f"--settings: setting {name!r}: {err}") from err


def setting_to_dict(output: object) -> dict:
    """A ResidualOutput as JSON (its policy as a dict)."""
    return json.loads(json.dumps(dataclasses.asdict(output), default=str))


def learn_key(output: object) -> str:
    """What a learning pass depends on: the ResidualOutput without its solve-time fields (SOLVE_TIME_OUTPUT_FIELDS
    and its policy's SOLVE_TIME_FIELDS). Settings with one key share a pass."""
    fields = {k: v for k, v in setting_to_dict(output).items() if k not in SOLVE_TIME_OUTPUT_FIELDS}
    fields["policy"] = {k: v for k, v in fields["policy"].items() if k not in SOLVE_TIME_FIELDS}
    return json.dumps(fields, sort_keys=True)


def split_readout(name: str, fields: Mapping) -> tuple[dict, str | None]:
    """A setting's fields as (the others, its readout or None): "shipped" or a save_pretrained folder holding a
    configuration with middle layers. A ValueError names the setting."""
    fields = dict(fields)
    readout = fields.pop(READOUT, None)
    if readout is None:
        return fields, None
    if not isinstance(readout, str) or not readout:
        raise ValueError(f"--settings: setting {name!r}: 'readout' expects \"shipped\" or a folder written by "
                         f"save_pretrained, got {readout!r}")  # fmt: skip
    if readout != "shipped" and not (Path(readout) / "faast_config.json").is_file():
        raise ValueError(f"--settings: setting {name!r}: 'readout' {readout!r} holds no faast_config.json")
    return fields, readout


def readout_folder(readout: str) -> Path:
    """The folder of a setting's readout ("shipped": faast.hf.default.DEFAULT_READOUT)."""
    from faast.hf.default import DEFAULT_READOUT

    return DEFAULT_READOUT if readout == "shipped" else Path(readout)


def groups(settings: Mapping[str, object], readouts: Mapping[str, str] | None = None,
           mlps: Mapping[str, MlpSpec] | None = None) -> list[list[str]]:  # fmt: skip
    """The settings' names in groups that share a learning pass, in the order given: a setting with a readout
    (`readouts`, by name) shares only with settings of the same readout, one with MLP memories (`mlps`) only with
    settings of the same blocks and ridge."""
    readouts, mlps = readouts or {}, mlps or {}
    by_key: dict[str, list[str]] = {}
    for name, output in settings.items():
        memories = mlps[name].learn_key() if name in mlps else None
        by_key.setdefault(f"{learn_key(output)}|{readouts.get(name)}|{memories}", []).append(name)
    return list(by_key.values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--domains", nargs="+", default=None, help="suite domains (default: all of the manifest)")
    p.add_argument("--settings", default='{"default": {}}', help="a JSON file or object (module docstring)")
    p.add_argument("--out", type=Path, required=True, help="the folder of the shard records (<domain>.json)")
    p.add_argument(
        "--path",
        choices=("float32", "auto"),
        default="float32",
        help="float32: learn_dtype='model', head_dtype='float32' (the issue's path); auto: faast's choice",
    )
    p.add_argument("--learn-tokens", type=int, default=32768)
    p.add_argument("--score-tokens", type=int, default=8192)
    p.add_argument("--curve", default=",".join(map(str, CURVE)),
                   help="learned-token points scored before the last ('' for the last alone)")  # fmt: skip
    p.add_argument("--window", type=int, default=1024, help="scoring window (tokens)")
    p.add_argument("--batch-size", type=int, default=2, help="scoring batch")
    p.add_argument("--learn-window", type=int, default=256)
    p.add_argument("--learn-batch-size", type=int, default=8)
    p.add_argument("--peers", default="", help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--train-window", type=int, default=256)
    p.add_argument("--train-batch-size", type=int, default=4)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--lora-lrs", default="3e-4,1e-3,3e-3")
    p.add_argument("--lora-max-epochs", type=int, default=3)
    p.add_argument("--knn-k", type=int, default=1024)
    p.add_argument("--knn-lams", default="0.05,0.1,0.25,0.4,0.6")
    p.add_argument("--knn-temperatures", default="1,3,10,30,100")
    p.add_argument("--manifest", type=Path, default=suite.MANIFEST)
    args = p.parse_args(argv)
    text = args.settings
    raw = Path(text).read_text(encoding="utf-8") if not text.lstrip().startswith("{") else text
    try:
        args.settings = json.loads(raw)
    except json.JSONDecodeError as err:
        p.error(f"--settings: expected a JSON object or a file holding one: {err}")
    if isinstance(args.settings, dict) and isinstance(args.settings.get("settings"), dict):
        args.settings = args.settings["settings"]  # a spec file ("about", "settings", "mechanisms"): its settings
    if not isinstance(args.settings, dict) or not args.settings:
        p.error(f"--settings: expected a non-empty JSON object of settings, got {args.settings!r}")
    args.peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    if set(args.peers) - set(PEERS):
        p.error(f"--peers: expected a subset of {list(PEERS)}, got {args.peers}")
    try:
        args.curve = sorted({int(x) for x in args.curve.split(",") if x.strip()})
        for name in ("lora_lrs", "knn_lams", "knn_temperatures"):
            setattr(args, name, [float(x) for x in getattr(args, name).split(",") if x.strip()])
    except ValueError as err:
        p.error(f"--curve, --lora-lrs, --knn-lams, --knn-temperatures: expected comma-separated numbers: {err}")
    return args


class SuiteDomain:
    """One domain's tokens and the peers' rows (lm_domains_peers.PeerDomain)."""

    def __init__(self, name: str, learn: list[list[int]], windows: list[list[int]]) -> None:
        self.name, self.learn, self.windows = name, learn, windows
        self.learned = sum(len(x) for x in learn)
        self.scored = sum(len(w) - 1 for w in windows)
        self.rows: list[dict] = []
        self.curve: dict = {}
        self.tuned: dict = {}
        self._split = None

    def add(self, method: str, result: object, learn_s: float, memory: int, **extra: object) -> None:
        self.rows.append({"method": method, "ppl": result.ppl, "learn_s": learn_s, "score_s": result.seconds,
                          "memory_bytes": memory, **extra})  # fmt: skip

    def split(self, base: object, args: argparse.Namespace) -> object:
        """FAAST's held-out tail of the learned texts (lm_baselines.tuning_split), which the tuned peers tune on."""
        if self._split is None:
            from faast.hf import ResidualOutput
            from faast_lab.experiments.lm_baselines import faast_min_fit, tuning_split

            min_fit = faast_min_fit(base.config.hidden_size)
            self._split = tuning_split(self.learn, ResidualOutput().tune_tokens, min_fit)
        return self._split

    def row(self, method: str) -> dict | None:
        return next((r for r in self.rows if r["method"] == method), None)


def protocol(args: argparse.Namespace, settings: Mapping[str, object], description: str,
             caches: Mapping[str, CacheSpec | TunedCacheSpec] | None = None,
             readouts: Mapping[str, str] | None = None,
             mlps: Mapping[str, MlpSpec] | None = None) -> dict:  # fmt: skip
    """What a shard's numbers depend on besides the text: a resumed run must match it. A cached setting's fields
    hold its cache under "cache", a setting with middle layers its readout under "readout", one with MLP memories
    its blocks, step and ridge under "mlp"."""
    keep = ("path", "learn_tokens", "score_tokens", "curve", "window", "batch_size", "learn_window",
            "learn_batch_size", "peers", "train_window", "train_batch_size")  # fmt: skip
    caches, readouts, mlps = caches or {}, readouts or {}, mlps or {}
    fields = {n: {**setting_to_dict(o), **({CACHE: caches[n].to_dict()} if n in caches else {}),
                  **({READOUT: readouts[n]} if n in readouts else {}),
                  **({MLP: mlps[n].to_dict()} if n in mlps else {})} for n, o in settings.items()}  # fmt: skip
    return {"model": description, **{k: getattr(args, k) for k in keep}, "settings": fields}


def what_is_read(layer: object, model: object) -> tuple:
    """What the output layer reads the held-out text with, as scoring will form it (the model's device and dtype):
    (M [width, d] or None, λ, the bias [d] or None, the token bias [V] or None), from the layer's public solution."""
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    m, lam = layer.solution(device, dtype)
    return m, lam, layer.folded_bias(device, dtype), layer.folded_token_bias(device, dtype)


def same_read(a: tuple, b: tuple) -> bool:
    """Whether two `what_is_read` are bit for bit one: then the scores are one (scoring is deterministic)."""
    import torch

    def same(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and bool(
                torch.equal(x, y))  # fmt: skip
        return x == y

    return all(same(x, y) for x, y in zip(a, b, strict=True))


def run_group(domain: SuiteDomain, base: object, names: Sequence[str], settings: Mapping, args: argparse.Namespace,
              tick: Callable[[int], None], caches: Mapping[str, CacheSpec | TunedCacheSpec] | None = None,
              states: CacheStates | None = None, readout: str | None = None,
              mlps: Mapping[str, MlpSpec] | None = None) -> dict:  # fmt: skip
    """One learning pass of a group's first setting, in the curve's parts; after each part every setting of the
    group solved (its policy and biases set on the layer) and scored, unless its solve reads as one already scored at
    that point bit for bit (a mechanism that did not act: the score is that one's, the row says whose in
    score_reused_from); a cached setting (`caches`, read from `states`) is solved only where no setting before it
    at that point has its ResidualOutput (else it takes that one's solve and score: solve_shared_with), then mixes
    its FAAST scores with the cache's (lm_suite_cache.read_at; a tuned cache chooses its λ and T on FAAST's scores
    of the held-out tail first); tick(tokens) after each step (the progress bar). readout: the group's middle layers
    (`split_readout`), loaded with from_pretrained under the group's first setting; None: the output layer alone.
    mlps: the group's MLP memories (lm_suite_mlp, one set of blocks): each learned part is also captured, and each
    setting learns its memories from the capture before it is solved. {setting: row}."""
    from faast.hf import FaastConfig, Regulariser, apply_faast, from_pretrained
    from faast.hf.evaluate import perplexity, token_log_probs
    from faast.hf.tokens import split_continuing

    caches = {n: c for n, c in (caches or {}).items() if n in names}
    if caches and states is None:
        raise ValueError(f"states: the settings {sorted(caches)} read a cache; expected its CacheStates, got None")

    tuned = any(isinstance(c, TunedCacheSpec) for c in caches.values())

    def score(model: object, learned: int) -> tuple:
        """(Perplexity, None or what a cache reads: FAAST's per-token log-probabilities and targets, and for a tuned
        cache its tail's log-probabilities and their seconds or None): token_log_probs' total is perplexity's."""
        if not caches:
            return perplexity(model, domain.windows, batch_size=args.batch_size, progress=False), None
        kept = token_log_probs(model, domain.windows, batch_size=args.batch_size, progress=False)
        tail, tail_scores = states.tails.get(learned) if tuned else None, None
        if tail is not None:
            started = time.perf_counter()
            tail_scores = (lm_suite_cache.faast_tail_log_probs(model, tail, args.batch_size),
                           time.perf_counter() - started)  # fmt: skip
        return kept.total, (kept.log_probs, kept.targets, tail_scores)

    path = {"learn_dtype": "model"} if args.path == "float32" else {}
    mlps = {n: s for n, s in (mlps or {}).items() if n in names}
    capture = None
    if mlps:
        blocks = check_blocks(base, mlps)
        path["target_modules"] = [module_name(b) for b in blocks]
        path["regulariser"] = Regulariser(ridge=next(iter(mlps.values())).ridge)  # one per group (groups)
        capture = MlpCapture(base, blocks, args.learn_window, args.learn_batch_size)
    if readout is None:
        model = apply_faast(base, FaastConfig(output=settings[names[0]], **path))
    else:  # the middle layers and their trained readout as saved, the output layer as the setting has it
        model = from_pretrained(base, readout_folder(readout), output=settings[names[0]], **path)
    middle = model.faast_config.middle
    amounts = sorted({p for p in args.curve if p < domain.learned} | {domain.learned})
    rows = {n: {"curve": {"tokens": amounts, "ppl": [], "solve_s": []}} for n in names}
    learn_s, mlp_s = 0.0, dict[str, float]()
    try:
        layer = model.output_memory_layer
        for point, (part, continues) in enumerate(split_continuing(domain.learn, amounts)):
            layer.policy = settings[names[0]].policy  # the pass learns under its group's learn-time fields
            started = time.perf_counter()
            if part:
                model.learn(part, max_length=args.learn_window, batch_size=args.learn_batch_size, continues=continues,
                            progress=False)  # fmt: skip
            learn_s += time.perf_counter() - started
            if capture is not None and part:
                capture.add(model, part, continues)
            tick(sum(len(x) for x in part))
            scored: list[tuple[tuple, str, object]] = []  # (what was read, setting, its perplexity) at this point
            solved: dict[str, tuple] = {}  # a cached setting's ResidualOutput -> the solve and score it was given
            for name in names:
                row = rows[name]
                fields = json.dumps(setting_to_dict(settings[name]), sort_keys=True)
                if name in caches and fields in solved:  # one ResidualOutput solves as one: the cache adds no solve
                    tuning, solve_s, result, per_token, memory, first = solved[fields]
                    row.setdefault("solve_shared_with", []).append(first)
                else:
                    layer.policy = settings[name].policy
                    # SOLVE_TIME_OUTPUT_FIELDS
                    layer.bias, layer.token_bias = settings[name].bias, settings[name].token_bias
                    if capture is not None:
                        mlp_s[name] = capture.learn(model, mlps.get(name))
                        if capture.choice is not None:  # a tuned step: what each point chose, on what held-out NLL
                            row.setdefault("mlp_curve", []).append(capture.choice)
                    started = time.perf_counter()
                    tuning = next(iter(model.solve(progress=False).values()), None) or {}
                    solve_s = time.perf_counter() - started
                    read = (*what_is_read(layer, model), mlps[name].to_dict() if name in mlps else None)
                    same = next(((n, r) for f, n, r in scored if same_read(f, read)), None)
                    if same is None:
                        result, per_token = score(model, amounts[point])
                        scored.append((read, name, (result, per_token)))
                    else:  # a setting whose solve came out bit for bit as another's reads as it: its score is that one
                        result, per_token = same[1]
                        if name not in caches:  # a cached one mixes that score with its cache: its own
                            row.setdefault("score_reused_from", []).append(same[0])
                    memory = model.fast_weight_bytes()
                    solved.setdefault(fields, (tuning, solve_s, result, per_token, memory, name))
                if name in caches:  # FAAST's scores of this solve, mixed with the cache's
                    faast_s = result.seconds
                    result, cost = lm_suite_cache.read_at(states, caches[name], amounts[point], result, per_token)
                    result.seconds = faast_s + cost["search_s"]
                    memory += cost["bytes"]
                    kept = ("pairs", "search_s") + (("lam", "temperature", "tune_s") if "tune_s" in cost else ())
                    curve = row.setdefault("cache_curve", {k: [] for k in kept})
                    for k in kept:
                        curve[k].append(cost[k])
                tick(domain.scored)
                row["curve"]["ppl"].append(result.ppl)
                row["curve"]["solve_s"].append(solve_s)
                row.update(ppl=result.ppl, score_s=result.seconds, solve_s=solve_s, memory_bytes=memory,
                           tuning={k: v for k, v in tuning.items() if k != "held_out_nll"})  # fmt: skip
        precision = model.learner.precision()
    finally:
        model.remove_faast()
    for name in names:
        rows[name].update(learn_s=learn_s + rows[name]["solve_s"], pass_learn_s=learn_s, shared_pass=list(names),
                          precision=precision)  # fmt: skip
        if middle is not None:  # the blocks whose inputs the middle layers rewrite
            rows[name]["middle_layers"] = list(middle.layers)
        if capture is not None and name in mlps:  # the capture passes and the last point's module learning count
            rows[name][MLP] = {**mlps[name].to_dict(), "capture_s": capture.seconds, "learn_s": mlp_s[name],
                               **({"chosen_step": rows[name]["mlp_curve"][-1]["step"]} if mlps[name].tuned
                                  else {})}  # fmt: skip
            rows[name]["learn_s"] += capture.seconds + mlp_s[name]
        if name in caches:  # the cache's pairs come from a pass of their own here (lm_suite_cache): counted
            rows[name]["cache"] = {**caches[name].to_dict(), "build_s": states.build_s, "query_s": states.query_s}
            rows[name]["learn_s"] += states.build_s
            curve = rows[name]["cache_curve"]
            if "tune_s" in curve:  # a tuned cache: its last point's choice, and that point's tuning in its time
                rows[name]["cache"].update(lam=curve["lam"][-1], temperature=curve["temperature"][-1],
                                           tune_s=curve["tune_s"][-1])  # fmt: skip
                rows[name]["learn_s"] += curve["tune_s"][-1]
            rows[name]["score_s"] += states.query_s
    return rows


def run_domain(name: str, base: object, tokenizer: object, settings: Mapping, args: argparse.Namespace,
               manifest: Mapping, bases: Mapping | None, tick: Callable[[int], None],
               caches: Mapping[str, CacheSpec | TunedCacheSpec] | None = None,
               readouts: Mapping[str, str] | None = None,
               mlps: Mapping[str, MlpSpec] | None = None) -> dict:  # fmt: skip
    """One shard: the domain's zero-shot, each setting's row and curve, the peers' rows. With `caches`, the cache's
    pairs and queries first (lm_suite_cache.build, the base model alone); `readouts`: the settings' middle layers
    (`split_readout`), by name; `mlps`: their MLP memories (lm_suite_mlp), by name."""
    import torch

    from faast.hf.evaluate import perplexity, token_windows
    from faast.hf.tokens import token_lists

    learn_texts, held_texts, record = suite.domain_texts(name, manifest, bases)
    torch.manual_seed(0)
    windows = [w for ids in token_lists(held_texts, tokenizer, args.score_tokens)
               for w in token_windows(ids, args.window)]  # fmt: skip
    domain = SuiteDomain(name, token_lists(learn_texts, tokenizer, args.learn_tokens), windows)
    zero = perplexity(base, windows, batch_size=args.batch_size, progress=False)
    tick(domain.scored)
    print(f"{name}: learn {domain.learned:,} tokens, score {domain.scored:,}; zero-shot {zero.ppl:.3f}", flush=True)
    states = None
    if caches:
        from faast.hf import ResidualOutput
        from faast_lab.experiments.lm_baselines import faast_min_fit

        tails_at = []
        if any(isinstance(c, TunedCacheSpec) for c in caches.values()):  # every curve point's tail
            tails_at = sorted({p for p in args.curve if p < domain.learned} | {domain.learned})
        states = lm_suite_cache.build(base, domain.learn, windows, window=args.window, batch_size=args.batch_size,
                                      tails_at=tails_at, tune_tokens=ResidualOutput().tune_tokens,
                                      min_fit=faast_min_fit(base.config.hidden_size))  # fmt: skip
        tick(domain.learned)
    rows: dict[str, dict] = {}
    readouts = readouts or {}
    for group in groups(settings, readouts, mlps):
        rows.update(run_group(domain, base, group, settings, args, tick, caches, states, readouts.get(group[0]),
                              mlps))  # fmt: skip
        for n in group:
            print(f"  {name} {n}: ppl {rows[n]['ppl']:.3f} (learn {rows[n]['pass_learn_s']:.1f} s, solve "
                  f"{rows[n]['solve_s']:.1f} s)", flush=True)  # fmt: skip
    for row in rows.values():
        row["reduction"] = 1 - row["ppl"] / zero.ppl
        row["curve"]["reduction"] = [1 - p / zero.ppl for p in row["curve"]["ppl"]]
    rows = {n: rows[n] for n in settings}
    peers = run_peers(domain, base, settings, rows, args) if args.peers else []
    for row in peers:
        row["reduction"] = 1 - row["ppl"] / zero.ppl
    return {"domain": name, "kind": record["kind"], "suite_domain": record, "learned_tokens": domain.learned,
            "scored_tokens": domain.scored, "zero_shot": {"ppl": zero.ppl, "score_s": zero.seconds},
            "settings": rows, "peers": peers}  # fmt: skip


def run_peers(domain: SuiteDomain, base: object, settings: Mapping, rows: Mapping, args: argparse.Namespace) -> list:
    """The peers' rows (lm_domains_peers), LoRA's rank matched to the shipped readout's layers as lm_domains does."""
    from faast.hf import FaastConfig
    from faast.hf.default import DEFAULT_READOUT
    from faast_lab.experiments import lm_domains_peers as peers

    layers = FaastConfig.load(DEFAULT_READOUT / "faast_config.json").middle.layers
    first = next(iter(settings))
    faast_row = f"FAAST: {first}"  # LoRA at FAAST's time reads this row's learn + solve time
    domain.rows.append({"method": faast_row, **{k: rows[first][k] for k in ("ppl", "learn_s", "score_s")}})
    if "lora" in args.peers:
        peers.run_backprop(domain, base, layers, "lora", args)
    if "lora_best" in args.peers:
        peers.run_lora_best(domain, base, layers, args)
    if "knn_tuned" in args.peers:
        peers.run_knn_tuned(domain, base, args)
    if "lora_time" in args.peers:
        peers.run_lora_time(domain, base, layers, args, faast_row)
    out = [r for r in domain.rows if r["method"] != faast_row]
    return json.loads(json.dumps(out, default=str))  # the tuning choices' fields as JSON


def main(argv: list[str] | None = None, *, load_model: ModelLoader | None = None, manifest: Mapping | None = None,
         bases: Mapping[str, Path] | None = None) -> list[Path]:  # fmt: skip
    """Run the suite's shards not yet in --out; returns every shard's path. load_model: the base model for 'smollm2'
    (default faast.hf.default.load_base_model); manifest, bases: a suite other than the committed one (tests)."""
    from faast.hf.default import load_base_model
    from faast.hf.progress import Bar, enabled

    args = parse_args(argv)
    manifest = suite.load_manifest(args.manifest) if manifest is None else manifest
    names = args.domains or [d["name"] for d in manifest["domains"]]
    for name in names:
        suite.entry(name, manifest)  # an unknown name fails before any model loads
    settings, caches, readouts, mlps = {}, {}, {}, {}
    for n, f in args.settings.items():
        fields, cache = split_cache(n, f) if isinstance(f, Mapping) else (f, None)
        fields, readout = split_readout(n, fields) if isinstance(fields, Mapping) else (fields, None)
        fields, mlp = split_mlp(n, fields) if isinstance(fields, Mapping) else (fields, None)
        settings[n] = setting_from_dict(n, fields, args.path)
        if cache is not None:
            caches[n] = cache
        if readout is not None:
            readouts[n] = readout
        if mlp is not None and readout is not None:  # from_pretrained's module memories: not wired, not measured
            raise ValueError(f"--settings: setting {n!r}: 'mlp' and 'readout' do not combine; expected one of them")
        if mlp is not None:
            mlps[n] = mlp
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [n for n in names if not (args.out / f"{n}.json").is_file()]
    base, tokenizer, description = (load_model or load_base_model)("smollm2")
    wanted = protocol(args, settings, description, caches, readouts, mlps)
    suite_sha = suite.manifest_sha256(manifest)
    for name in sorted(set(names) - set(todo)):
        have = json.loads((args.out / f"{name}.json").read_text(encoding="utf-8"))
        if have.get("protocol") != json.loads(json.dumps(wanted)):
            raise SystemExit(f"--out {args.out}: the shard {name}.json ran another protocol (settings, tokens or "
                             "windows); resume with the same options or write to another folder")  # fmt: skip
        if (have.get("suite") or {}).get("manifest_sha256") != suite_sha:
            raise SystemExit(f"--out {args.out}: the shard {name}.json ran another suite manifest")
    # One unit per learned part and per scoring of each setting: the bar's time left is the shards' left.
    passes = groups(settings, readouts, mlps)
    steps_per_domain = 1 + bool(caches) + sum(len(g) + 1 for g in passes) * (len(args.curve) + 1)
    total, done = len(todo) * steps_per_domain, 0
    bar = Bar(enabled(None), "suite")

    def tick(tokens: int) -> None:
        nonlocal done
        done += 1
        bar.update(tokens, min(1.0, done / total) if total else None)

    try:
        write_shards(args.out, todo, lambda n: run_domain(n, base, tokenizer, settings, args, manifest, bases, tick,
                                                          caches, readouts, mlps), suite_sha, wanted)  # fmt: skip
    finally:
        bar.close()
    return [args.out / f"{n}.json" for n in names]


def write_shards(out: Path, names: Sequence[str], run: Callable[[str], dict], suite_sha: str, wanted: dict) -> None:
    """Each domain's shard, out/<name>.json, written atomically as it finishes: the provenance of its run (started
    before it), the suite manifest's hash, the protocol and run(name)'s fields (also lm_suite_timing's)."""
    from faast import provenance
    from faast.persist import write_text_atomic

    for name in names:
        record = provenance.start(ROOT)
        shard = run(name)
        payload = {"provenance": provenance.finish(record), "suite": {"manifest_sha256": suite_sha},
                   "protocol": wanted, **shard}  # fmt: skip
        write_text_atomic(out / f"{name}.json", json.dumps(payload, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
