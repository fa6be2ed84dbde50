// rondo_tiny_model <dir> [seed [layers hidden intermediate]]: writes the tiny model folder of
// tests/support/tiny_model_folder.h — for tests that must not link torch themselves (the GUI's),
// and, sized up, for trying runs by hand.
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "tiny_model_folder.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: rondo_tiny_model <dir> [seed [layers hidden intermediate]]\n");
    return 2;
  }
  try {
    if (argc > 5)
      rondo::test::write_tiny_model_folder(argv[1], std::atoi(argv[2]), std::atoi(argv[3]), 512,
                                           std::atoi(argv[4]), std::atoi(argv[5]));
    else
      rondo::test::write_tiny_model_folder(argv[1], argc > 2 ? std::atoi(argv[2]) : 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rondo_tiny_model: %s\n", e.what());
    return 1;
  }
  return 0;
}
