/*
 * refresh: an inference server's side of refit in plain C. Loads librefit.so
 * with dlopen(), takes its function table, registers one buffer and
 * refreshes it from whatever sources are publishing.
 *
 *   refresh LIBRARY HOST:PORT TOKEN_FILE OUT_FILE [NETWORK_DEVICE]
 *
 * The buffer holds rows 2..5 of the tensor "example.w" (F32, shape [8, 16],
 * row-major): 4 x 16 floats. After the refresh the program prints the
 * refresh report and writes the buffer's 256 bytes to OUT_FILE. A source
 * must be serving "example.w" through the coordinator at HOST:PORT
 * (tests/e2e/examples_test.cc starts one). NETWORK_DEVICE restricts UCX to
 * one device, e.g. "lo" when everything runs on one host.
 *
 * Exit status: 0 when the buffer was refreshed and written, 1 otherwise, 2 on
 * bad arguments.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "refit/refit.h"

#define ROWS 4
#define COLS 16

int main(int argc, char** argv) {
  if (argc < 5 || argc > 6) {
    fprintf(stderr, "usage: %s LIBRARY HOST:PORT TOKEN_FILE OUT_FILE [NETWORK_DEVICE]\n", argv[0]);
    return 2;
  }
  const char* library = argv[1];
  const char* address = argv[2];
  const char* token_file = argv[3];
  const char* out_file = argv[4];
  const char* device = argc == 6 ? argv[5] : NULL;

  void* dl = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (dl == NULL) {
    fprintf(stderr, "refresh: cannot load %s: %s\n", library, dlerror());
    return 1;
  }
  typedef const refit_api_t* (*get_api_fn)(uint32_t);
  get_api_fn get_api = (get_api_fn)dlsym(dl, "refit_get_api");
  if (get_api == NULL) {
    fprintf(stderr, "refresh: %s has no refit_get_api: %s\n", library, dlerror());
    return 1;
  }
  const refit_api_t* api = get_api(REFIT_ABI_VERSION);
  /* The table starts with its version and size: check both before reading
   * any entry, so that an older library is refused rather than misread. */
  if (api == NULL || api->abi_version != REFIT_ABI_VERSION || api->size < sizeof(refit_api_t)) {
    fprintf(stderr, "refresh: %s does not serve ABI version %u with a table of at least %zu bytes\n", library,
            REFIT_ABI_VERSION, sizeof(refit_api_t));
    return 1;
  }

  char devices[128] = "";
  if (device != NULL) snprintf(devices, sizeof devices, ", \"devices\": [\"%s\"]", device);
  char config[2048];
  snprintf(config, sizeof config,
           "{\"rank\": 0, \"domain\": 0, \"instance\": 0,"
           " \"coordinator\": {\"address\": \"%s\", \"token_file\": \"%s\", \"timeout_ms\": 10000},"
           " \"network\": {\"transports\": [\"tcp\"]%s}}",
           address, token_file, devices);

  static float rows[ROWS * COLS];
  const char* buffer =
      "{\"name\": \"w_rows\", \"dtype\": \"F32\", \"segments\": [{\"tensor\": \"example.w\","
      " \"start\": [2, 0], \"size\": [4, 16], \"offset\": 0, \"strides\": [16, 1]}]}";

  int rc = 1;
  refit_receiver_t* rx = NULL;
  refit_status_t s = api->receiver_create(config, &rx);
  if (s != REFIT_OK) {
    fprintf(stderr, "refresh: refit_receiver_create: %s: %s\n", api->status_name(s), api->last_error());
    goto done;
  }
  s = api->receiver_add_buffer(rx, buffer, rows, sizeof rows);
  if (s != REFIT_OK) {
    fprintf(stderr, "refresh: refit_receiver_add_buffer: %s: %s\n", api->status_name(s), api->last_error());
    goto done;
  }
  s = api->receiver_refresh(rx, REFIT_LATEST, 30000);
  if (s != REFIT_OK) {
    fprintf(stderr, "refresh: refit_receiver_refresh: %s: %s\n", api->status_name(s), api->last_error());
    goto done;
  }
  printf("refreshed to version %lld: %s\n", (long long)api->receiver_version(rx), api->receiver_report(rx));

  FILE* out = fopen(out_file, "wb");
  if (out == NULL || fwrite(rows, 1, sizeof rows, out) != sizeof rows || fclose(out) != 0) {
    fprintf(stderr, "refresh: cannot write %s\n", out_file);
    goto done;
  }
  rc = 0;
done:
  api->receiver_destroy(rx);
  /* librefit is not dlclose()d: its threads are gone after destroy, but a
   * library with C++ statics is safest left loaded until exit. */
  return rc;
}
