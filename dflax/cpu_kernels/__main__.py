"""`python -m dflax.cpu_kernels`: builds every CPU kernel into dflax's cache (what `.ci/setup` runs once)."""

from dflax.cpu_kernels.build import build_all

for name, built in build_all().items():
    print(f"{name}: {built}")
