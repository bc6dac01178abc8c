"""`python -m camshaft ...`: the camshaft command line."""

from camshaft.cli import main

main()
