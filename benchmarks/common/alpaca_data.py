"""Alpaca-format JSONL rows with a realistic length profile, from a fixed seed.

    python benchmarks/common/alpaca_data.py --rows 96 --out runs/bench/train.jsonl
    python benchmarks/common/alpaca_data.py --rows 64 --seed 2 --out runs/bench/eval.jsonl --tokenizer MODEL_DIR

Every stack in bench.py trains on the same file, so throughput depends on the same mix of short and
long rows as real instruction data: about 85% of the rows are 50-200 tokens (prompt + response with
the SmolLM2 tokenizer), the rest a tail up to ~500. The text is sentences of common English words
(no meaning, but tokenizer statistics close to prose). `--tokenizer` prints the token-length
percentiles of the rows as trainyard encodes them (alpaca prompt + response + eos).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

WORDS = """
the of and to in is was for on that with as by at from it be this are an or which have has not
but had were their they one all been would there more can when who will about also into other
time its new some could these two may first then do any like only over such our out what used
most after many well made people year work where through years back way because just good each
those world both being under while life three part water system group number day last state
however high small large place between long great before case point fact change order line
city house power form show hand school right end light side name problem party word line point
family country story study program question during government company service report level
market process council area team table music field model result class data paper rate river
valley garden window morning evening summer winter letter table engine signal market bridge
careful simple quiet bright early later often never always rather quite almost every another
write read open close build carry share follow measure explain describe compare choose prepare
improve reduce increase support travel return receive develop create provide require include
""".split()
INSTRUCTION_VERBS = ["Explain", "Describe", "Summarize", "Rewrite", "Compare", "List", "Translate", "Classify"]
TOKENS_PER_WORD = 1.1  # these words with spaces and punctuation, SmolLM2's tokenizer (measured)
PROMPT_OVERHEAD = 12  # the alpaca template's fixed tokens


def sentence(rng: random.Random, words: int) -> str:
    picked = [rng.choice(WORDS) for _ in range(max(words, 1))]
    return " ".join([picked[0].capitalize(), *picked[1:]]) + rng.choice([".", ".", ".", ",", "?"])


def paragraph(rng: random.Random, words: int) -> str:
    """About `words` words as sentences of 6-18 words."""
    parts, left = [], words
    while left > 0:
        size = min(left, rng.randint(6, 18))
        parts.append(sentence(rng, size))
        left -= size
    return " ".join(parts)


def target_tokens(rng: random.Random) -> int:
    """Prompt + response tokens: most rows 50-200, a long tail to ~500."""
    if rng.random() < 0.85:
        return int(min(200, max(50, rng.lognormvariate(4.55, 0.35))))
    return rng.randint(200, 500)


def make_row(rng: random.Random) -> dict[str, str]:
    budget = max(target_tokens(rng) - PROMPT_OVERHEAD, 30)
    instruction_words = rng.randint(6, 24)
    input_words = rng.randint(10, max(11, budget // 3)) if rng.random() < 0.4 else 0
    used = (instruction_words + input_words) * TOKENS_PER_WORD
    output_words = max(int((budget - used) / TOKENS_PER_WORD), 8)
    instruction = f"{rng.choice(INSTRUCTION_VERBS)} {paragraph(rng, instruction_words).lower()}"
    return {
        "instruction": instruction,
        "input": paragraph(rng, input_words) if input_words else "",
        "output": paragraph(rng, output_words),
    }


def make_rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [make_row(rng) for _ in range(count)]


def write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def token_lengths(rows: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """Tokens per row as trainyard's alpaca encoder counts them: prompt + response + eos."""
    from trainyard.data.formats import alpaca_prompt

    return [
        len(tokenizer(alpaca_prompt(row["instruction"], row["input"]))["input_ids"])
        + len(tokenizer(row["output"], add_special_tokens=False)["input_ids"])
        + 1
        for row in rows
    ]


def percentiles(lengths: list[int]) -> dict[str, float]:
    ordered = sorted(lengths)

    def at(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    return {
        "rows": len(ordered),
        "mean": round(sum(ordered) / len(ordered), 1),
        **{f"p{int(q * 100)}": at(q) for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)},
        "share_50_200": round(sum(50 <= n <= 200 for n in ordered) / len(ordered), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder: print token-length percentiles")
    args = parser.parse_args()
    rows = make_rows(args.rows, args.seed)
    write_jsonl(rows, Path(args.out))
    print(f"wrote {len(rows)} rows to {args.out}")
    if args.tokenizer:
        from transformers import AutoTokenizer

        print(json.dumps(percentiles(token_lengths(rows, AutoTokenizer.from_pretrained(args.tokenizer)))))


if __name__ == "__main__":
    main()
