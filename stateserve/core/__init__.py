"""The data every level passes down: a request (core/request.py), the scheduler's choice for one step and the flat
inputs the runner builds from it (core/batch.py). Imports nothing above the layers."""
