#pragma once
// Symbols are hidden by default (CMAKE_CXX_VISIBILITY_PRESET hidden); the public API is marked here.
#define FERRY_API __attribute__((visibility("default")))
