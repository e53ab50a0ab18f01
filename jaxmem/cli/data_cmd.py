"""`jaxmem data CONFIG --preview`: what the run will train on, before it runs."""
from __future__ import annotations

import argparse
import sys
from jaxmem.loader import load_config
from jaxmem.io.data import RecordSource, make_source, packing_summary, untrained_line
from jaxmem.cli.help import HelpFormatter

_DESCRIPTION = """\
Read the config's training data as a run would (records tokenized and packed into rows of train.seq_len,
cached on disk), then print a rendered sample with its trained tokens marked and the packing statistics:
documents, rows, filled and trained tokens, packing efficiency, overlong documents split or dropped. Nothing
is compiled and no device is used."""
_EPILOG = """\
examples:
  jaxmem data configs/sft/llama3-8b-chat-8xh100.yaml --preview data.path=chats.jsonl data.tokenizer=tok/tokenizer.json
  jaxmem data configs/sft/llama3-8b-chat-8xh100.yaml --preview --documents 3 data.packing=first_fit"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxmem data", description=_DESCRIPTION, epilog=_EPILOG,
                                 formatter_class=HelpFormatter)
    ap.add_argument("config", help="a config YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    ap.add_argument("--preview", action="store_true", help="print rendered documents with the trained tokens "
                                                           "marked (default: statistics only)")
    ap.add_argument("--documents", type=int, default=1, help="how many documents (preference pairs: pairs) to "
                                                             "preview (default: 1)")
    args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.config, args.overrides)
    source = make_source(cfg, refuse_untrained=False)  # shown, with a warning: `jaxmem train` refuses it
    if not isinstance(source, RecordSource):
        print(f"data.kind={cfg.data.kind}: token windows of train.seq_len + 1 = {cfg.train.seq_len + 1}; "
              "no documents, masks or packing to preview (use jsonl, parquet or hf)")
        return 0
    rows = source.rows
    if cfg.data.format == "preference":  # pairs: what was skipped and cut is summed up in the first line
        print(rows.describe(pairs=args.documents) if args.preview else rows.summary())
        return 0
    if not rows.stats["trained_tokens"]:
        print(f"jaxmem data: warning: {untrained_line(cfg)}", file=sys.stderr)
    if args.preview:
        print(rows.describe(documents=args.documents))  # decoded with the rows' own tokenizer
    else:
        print(packing_summary(rows, cfg.train.seq_len))
    return 0
