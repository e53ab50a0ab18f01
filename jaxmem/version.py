"""jaxmem's version (the package root and the command line read it from here)."""
__version__ = "0.1.0"
