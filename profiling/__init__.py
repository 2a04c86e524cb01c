"""Measuring a model: its shape and routing (``inspect-model``), its forward-pass times against
batch size and tokens per sequence (``profile-target``), and speculative decoding at several batch
sizes (``profile-batch``). What they measure is stored through the catalog; fitting and drawing
it is :mod:`analysis`'s."""
