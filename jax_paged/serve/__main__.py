import sys

from jax_paged.serve.cli import serve_main

sys.exit(serve_main())
