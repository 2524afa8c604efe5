// The CUDA runtime as the CPU emulator provides it (emulate.h).
#pragma once
#include "emulate.h"
