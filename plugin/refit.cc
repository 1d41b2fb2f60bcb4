// The C ABI's entry points. Every symbol outside refit_* stays local
// (refit.map), so the library can share a process with other C++ libraries.
#include "refit/refit.h"

extern "C" REFIT_EXPORT const char* refit_version(void) { return REFIT_VERSION_STRING; }
