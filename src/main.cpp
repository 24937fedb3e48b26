// trainer: the executable. Everything it does is the command line's (src/cli.cpp).
#include "cli.h"

int main(int argc, char** argv) { return sl::run_cli(argc, argv); }
