"""Write a toy translation task whose target is its source reversed, as the runner's
``[corpus] raw`` folder (``{train,valid,test}.{src,tgt}``).

Reversal needs attention that finds, for each target position, one source position far from
its own: the alignment a translation model learns first, without a large corpus. Used by
``examples/experiment/dc-shape-*.toml`` (docs/numerics.md, "Enc-DC"). Deterministic per
``--seed``; a few seconds::

    python scripts/reversal_corpus.py work-reversal --train 4000 --valid 200 --test 200
"""
import argparse
import os
import random


def write(directory: str, sizes, vocabulary: int, min_len: int, max_len: int, seed: int) -> None:
    words = [f"w{i}" for i in range(vocabulary)]
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    for split, count in sizes:
        with open(os.path.join(directory, f"{split}.src"), "w") as src, \
                open(os.path.join(directory, f"{split}.tgt"), "w") as tgt:
            for _ in range(count):
                sentence = [rng.choice(words) for _ in range(rng.randint(min_len, max_len))]
                src.write(" ".join(sentence) + "\n")
                tgt.write(" ".join(reversed(sentence)) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    for split, default in (("train", 4000), ("valid", 200), ("test", 200)):
        parser.add_argument(f"--{split}", type=int, default=default, help=f"sentences (default {default})")
    parser.add_argument("--vocabulary", type=int, default=24, help="distinct words (default 24)")
    parser.add_argument("--min-len", type=int, default=3, help="words per sentence, at least (default 3)")
    parser.add_argument("--max-len", type=int, default=9, help="words per sentence, at most (default 9)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len or min(args.train, args.valid, args.test, args.vocabulary) < 1:
        parser.error("need 1 <= --min-len <= --max-len and positive sizes")
    write(args.directory, (("train", args.train), ("valid", args.valid), ("test", args.test)),
          args.vocabulary, args.min_len, args.max_len, args.seed)


if __name__ == "__main__":
    main()
