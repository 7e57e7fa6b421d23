"""`python -m faast.demo`: the LM test-time adaptation demo, which lives in faast.hf.demo (run with --help)."""

from .hf.demo import main

if __name__ == "__main__":
    main()
