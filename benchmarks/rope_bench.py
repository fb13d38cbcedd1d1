"""RoPE on q and k, posenc against its peers and the memory floors: `python benchmarks/rope_bench.py [--quick]`.

The same harness as `posenc bench` (src/posenc/bench.py); see docs/performance.md for how to read it.
"""

import argparse
import sys

from posenc.bench import add_parser

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="rope_bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *sys.argv[1:]])
    sys.exit(args.run(args))
