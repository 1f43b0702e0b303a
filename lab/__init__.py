"""The lab: how the demo model's conversion and the offline data were made (maintainers only).

Not part of the moetool package and never imported by it: `moetool demo-model` applies the
committed conversion, `make fit-demo` refits it here, `make data` re-extracts the data. Run its
modules from the repository root (`python -m lab.fit_demo_moe`); lab/README.md says what each holds.
"""
