"""Scorers (GenEval, DPG-Bench, fidelity, CLIPScore, speed) and the run machinery that generates, caches, scores and
collects."""
