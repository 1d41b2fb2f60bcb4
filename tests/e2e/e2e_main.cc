// main() of the end-to-end tests. meson runs each case on its own with
// --gtest_filter (so that each has its own timeout); a filter that matches
// nothing, say after a rename, must fail instead of passing with no test.
#include <cstdio>

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  if (::testing::UnitTest::GetInstance()->test_to_run_count() == 0) {
    std::fprintf(stderr, "no test matches the filter: the meson test list and the test names disagree\n");
    return 1;
  }
  return rc;
}
