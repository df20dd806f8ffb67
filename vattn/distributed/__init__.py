"""Tensor parallelism: the ranks (`ranks`), what rank 0 tells them each step
(`group`), and every rank's cache in lockstep with rank 0's (`lockstep`)."""
