// librefit.so as a server sees it: loaded with dlopen, exporting refit_* only.
#include <dlfcn.h>

#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "refit/refit.h"

namespace {

TEST(Exports, DlopenAndVersion) {
  // RTLD_NODELETE, as a server that keeps librefit.so for its lifetime: the
  // UCX libraries it loads keep allocations in their globals until the
  // process ends, and unloading them would leave LeakSanitizer reporting
  // those as leaks of an unknown module.
  void* lib = dlopen(REFIT_LIBRARY, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  ASSERT_NE(lib, nullptr) << dlerror();
  using VersionFn = const char* (*)();
  auto version = reinterpret_cast<VersionFn>(dlsym(lib, "refit_version"));
  ASSERT_NE(version, nullptr) << dlerror();
  EXPECT_STREQ(version(), REFIT_VERSION_STRING);
  // Every entry point of the table is exported under its own name too.
  for (const char* name : {"refit_get_api", "refit_set_log_callback", "refit_receiver_commit"}) {
    EXPECT_NE(dlsym(lib, name), nullptr) << name << ": " << dlerror();
  }
  using GetApiFn = const refit_api_t* (*)(uint32_t);
  auto get_api = reinterpret_cast<GetApiFn>(dlsym(lib, "refit_get_api"));
  ASSERT_NE(get_api, nullptr);
  const refit_api_t* api = get_api(REFIT_ABI_VERSION);
  ASSERT_NE(api, nullptr);
  EXPECT_EQ(api->size, sizeof(refit_api_t));
  EXPECT_EQ(reinterpret_cast<void*>(api->set_log_callback), dlsym(lib, "refit_set_log_callback"));
  dlclose(lib);
}

TEST(Exports, OnlyRefitSymbolsAreExported) {
  const std::string cmd = std::string("nm -D --defined-only ") + REFIT_LIBRARY;
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::vector<std::string> names;
  char line[4096];
  while (fgets(line, sizeof line, p)) {
    std::string s(line);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    auto sp = s.rfind(' ');
    names.push_back(sp == std::string::npos ? s : s.substr(sp + 1));
  }
  ASSERT_EQ(pclose(p), 0) << "nm failed: " << cmd;
  ASSERT_FALSE(names.empty());
  bool has_version = false;
  for (const std::string& n : names) {
    EXPECT_EQ(n.rfind("refit_", 0), 0u) << "exported symbol outside refit_*: " << n;
    has_version = has_version || n == "refit_version";
  }
  EXPECT_TRUE(has_version);
}

}  // namespace
