/* fuzz.h - the libFuzzer entry point every target defines. */
#ifndef EXL_FUZZ_H
#define EXL_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
