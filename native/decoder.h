#pragma once
#include <Python.h>

/* decoder_layers(layers, residual, x, qkv, attention, o, gate_up, act, down, cos, sin, requests, sampled, heads,
 * threads): every decoder layer of a step in one call; see decoder.c */
extern PyMethodDef DECODER_METHODS[];
