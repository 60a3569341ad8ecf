"""Analysis scripts: probes and reports on models and finished runs, apart from the scorers; each takes every path
as an argument and calls the decoders' and scorers' code instead of copying it."""
