"""``python -m hf_lisa.train`` (and ``accelerate launch -m hf_lisa.train``): see :func:`hf_lisa.train.main`."""

from .run import main

if __name__ == "__main__":
    main()
