// librefit.so as a server sees it: loaded with dlopen, exporting refit_* only.
#include <dlfcn.h>

#include <cstdio>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "refit/refit.h"

namespace {

TEST(Exports, DlopenAndVersion) {
  void* lib = dlopen(REFIT_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  using VersionFn = const char* (*)();
  auto version = reinterpret_cast<VersionFn>(dlsym(lib, "refit_version"));
  ASSERT_NE(version, nullptr) << dlerror();
  EXPECT_STREQ(version(), REFIT_VERSION_STRING);
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
