// The test main for Catch2 v2; with v3, Catch2::Catch2WithMain provides it instead.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
