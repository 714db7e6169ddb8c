"""``python -m hf_lisa.train`` (and ``accelerate launch -m hf_lisa.train``): ``hf-lisa train``, with its messages and
exit status (:func:`hf_lisa.cli.main`)."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
