/*
 * refit: the C ABI of librefit.so.
 *
 * Plain C, no C++ types, no exceptions across it. Only symbols that start
 * with refit_ are exported from the library.
 */
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define REFIT_EXPORT __attribute__((visibility("default")))
#else
#define REFIT_EXPORT
#endif

/**
 * The library's version, "MAJOR.MINOR.PATCH".
 *
 * @return a static string owned by the library; never NULL.
 * @note   Any thread may call it, at any time, before or without any other call.
 */
REFIT_EXPORT const char* refit_version(void);

#ifdef __cplusplus
}
#endif

